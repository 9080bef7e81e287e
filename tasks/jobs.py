"""Submit Ray jobs through the Jobs API and watch them: status polling, log tail, progress artifact."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import acreate_progress_artifact, aupdate_progress_artifact
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config
from ray_jobs.storage import Layout, read_bytes, write_json_atomic
from tasks import registry
from tasks.cluster import ClusterError, ClusterHandle, _reachable, jobs_client
from tasks.logs import run_logger

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# What never travels to the cluster in runtime_env.working_dir (the venv alone is GBs).
WORKING_DIR_EXCLUDES = [
    ".venv/", ".git/", ".unbroken/", "tests/", "bench/", "**/__pycache__/", "*.egg-info/", ".ruff_cache/",
    ".pytest_cache/",
]  # fmt: skip


class JobFailed(RuntimeError):
    """A Ray job ended in a state other than SUCCEEDED."""


class ClusterLost(JobFailed):
    """The cluster stopped answering while a job ran on it (the job's fate is unknown)."""


AGENT_WAIT_S = 60.0  # how long a submission retries "No available agent to submit job" (a head still starting)
LOST_AFTER_ERRORS = 5  # consecutive failed status polls that mean the cluster is gone, not a blip


def stop_and_wait(address: str, submission_id: str, wait_s: float = 60.0) -> bool:
    """Stop a Ray job if the cluster still runs it and wait until Ray says it ended; False when there was nothing
    to stop (cluster gone, no such job, already ended). ClusterError if it outlives ``wait_s``."""
    if _reachable(address) is not None:
        return False
    client = jobs_client(address)
    try:
        if client.get_job_status(submission_id).is_terminal():
            return False
        client.stop_job(submission_id)
    except RuntimeError:  # not found: nothing to stop
        return False
    deadline = time.monotonic() + wait_s
    while not client.get_job_status(submission_id).is_terminal():
        if time.monotonic() > deadline:
            raise ClusterError(f"Ray job {submission_id} did not stop within {wait_s:.0f}s")
        time.sleep(0.5)
    return True


def write_job_spec(cfg: Config, attempt: int, manifest_url: str, model_path: str, resume_from: str | None) -> str:
    """Everything a job needs, on shared storage where the cluster can read it; returns its URL."""
    url = Layout(cfg.storage).job_spec(cfg.name, attempt)
    spec = {
        "config": json.loads(cfg.model_dump_json()),
        "manifest_url": manifest_url,
        "model_path": model_path,
        "resume_from": resume_from,
        "attempt": attempt,
    }
    write_json_atomic(url, spec)
    return url


def submit(handle: ClusterHandle, submission_id: str, module: str, spec_url: str) -> str:
    """Submit ``python -m <module> --spec <url>``; a job already submitted under this id is not submitted twice."""
    log = run_logger()
    client = jobs_client(handle.address)
    if any(j.submission_id == submission_id for j in client.list_jobs()):
        log.info("Ray job %s was already submitted; watching it", submission_id)
        return submission_id
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            client.submit_job(
                entrypoint=f"{shlex.quote(handle.python)} -m {module} --spec {shlex.quote(spec_url)}",
                submission_id=submission_id,
                runtime_env={"working_dir": str(PROJECT_ROOT), "excludes": WORKING_DIR_EXCLUDES},
                entrypoint_num_cpus=0,
            )
            break
        except RuntimeError as e:  # a head that just started answers before its job agent is up
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            log.info("the cluster's job agent is not up yet; retrying the submission")
            time.sleep(1.0)
    log.info("submitted Ray job %s (%s)", submission_id, module)
    return submission_id


@task(name="submit-job", cache_policy=NO_CACHE)
def submit_job(handle: ClusterHandle, submission_id: str, spec_url: str) -> str:
    """Submit the training job (``ray_jobs.job``)."""
    return submit(handle, submission_id, "ray_jobs.job", spec_url)


def last_step(metrics_url: str) -> int:
    """Newest step in metrics.jsonl (0 when there is none yet)."""
    try:
        lines = read_bytes(metrics_url).decode().strip().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


async def _forward_logs(client, submission_id: str, log) -> None:
    async for chunk in client.tail_job_logs(submission_id):
        for line in _ANSI.sub("", chunk).splitlines():
            if line.strip():
                log.info("[ray] %s", line.rstrip())


async def watch(handle: ClusterHandle, submission_id: str, poll_s: float = 2.0, on_poll=None) -> str:
    """Poll the job until it ends, forwarding its log; stop the job if the watch itself is interrupted."""
    from ray.job_submission import JobStatus

    log = run_logger()
    client = jobs_client(handle.address)
    tail = asyncio.create_task(_forward_logs(client, submission_id, log))
    status = None
    errors = 0
    try:
        while True:
            try:
                status = await asyncio.to_thread(client.get_job_status, submission_id)
                errors = 0
            except Exception as e:  # connection refused, timeouts: the head may be gone
                errors += 1
                if errors >= LOST_AFTER_ERRORS:
                    raise ClusterLost(f"the Ray cluster at {handle.address} stopped answering: {e}") from e
                await asyncio.sleep(poll_s)
                continue
            if on_poll is not None:
                await on_poll(status)
            if status.is_terminal():
                break
            await asyncio.sleep(poll_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(tail), timeout=15)  # let the last log lines arrive
    finally:
        tail.cancel()
        if status is None or not status.is_terminal():
            try:
                client.stop_job(submission_id)
                log.warning("watch interrupted: stopped Ray job %s", submission_id)
            except Exception as e:
                log.warning("watch interrupted; could not stop Ray job %s: %s", submission_id, e)
    if status != JobStatus.SUCCEEDED:
        info = client.get_job_info(submission_id)
        raise JobFailed(f"Ray job {submission_id} ended {status}: {info.message}")
    return str(status)


@task(name="watch-job", cache_policy=NO_CACHE)
async def watch_job(handle: ClusterHandle, submission_id: str, cfg: Config, attempt: int, poll_s: float = 2.0) -> str:
    """Watch the training job: log tail into Prefect, a progress artifact (step / max_steps) while it runs, the
    registry's ``running`` state once Ray runs it."""
    metrics_url = Layout(cfg.storage).metrics(cfg.name)
    progress_id = await acreate_progress_artifact(
        0.0, key=f"{cfg.name}-progress", description=f"training steps of {cfg.name}"
    )

    async def update_progress(status) -> None:
        if str(status) == "RUNNING":
            await asyncio.to_thread(registry.mark_running, cfg.storage, cfg.name, attempt)
        step = await asyncio.to_thread(last_step, metrics_url)
        await aupdate_progress_artifact(progress_id, progress=min(100.0, 100.0 * step / cfg.train.max_steps))

    return await watch(handle, submission_id, poll_s, on_poll=update_progress)


@task(name="prefetch-shards", cache_policy=NO_CACHE)
async def prefetch_shards(handle: ClusterHandle, submission_id: str, spec_url: str) -> list[dict[str, Any]]:
    """Run the preflight job: check cluster resources, then warm every node's shard cache (checksum-verified)."""
    submit(handle, submission_id, "ray_jobs.preflight", spec_url)
    client = jobs_client(handle.address)
    try:
        await watch(handle, submission_id, poll_s=1.0)
    except JobFailed as e:
        logs = client.get_job_logs(submission_id)
        reasons = [ln.split("PREFLIGHT FAILED: ", 1)[1] for ln in logs.splitlines() if "PREFLIGHT FAILED: " in ln]
        raise JobFailed(f"preflight failed: {reasons[0] if reasons else e}") from e
    logs = client.get_job_logs(submission_id)
    nodes = [json.loads(ln.split("PREFLIGHT CACHE ", 1)[1]) for ln in logs.splitlines() if "PREFLIGHT CACHE " in ln]
    for n in nodes:
        run_logger().info("shard cache on node %s: %s", n["node"], n)
    return nodes
