"""What keeps a finetune flow run and its Ray job in step: one active run per run name, and no Ray job left
running after its flow run was cancelled or crashed.

Prefect delivers a cancel of a served run by SIGTERM to the run's process (the flow's ``finally`` blocks run, as
does the watch task's, which stops the job) and then runs ``on_cancellation`` hooks in the serving process; a crash
(the run's process died) only reaches the hooks. Hooks are best-effort, so both paths stop the job, and stopping
twice is harmless.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from ray_jobs.config import ConfigError, load_config
from tasks import registry
from tasks.logs import run_logger

SLOT_LEASE_S = 60  # a crashed holder's slot frees itself after this long


@contextlib.asynccontextmanager
async def one_run_per_name(run: str) -> AsyncIterator[None]:
    """Hold the global concurrency limit ``unbroken-run-<run>`` (limit 1) for the whole flow run: a second run of
    the same name waits for the first instead of training into the same checkpoints."""
    from prefect import get_client
    from prefect.concurrency.asyncio import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = f"unbroken-run-{run}"
    async with get_client() as client:
        with contextlib.suppress(ObjectAlreadyExists):  # two first runs racing to create it
            await client.upsert_global_concurrency_limit_by_name(name, 1)
    run_logger().info("waiting for concurrency slot %s (one active run per run name)", name)
    async with concurrency(name, occupy=1, strict=True, lease_duration=SLOT_LEASE_S):
        yield


def _config_of(flow_run):
    from flows.finetune import run_options

    p = flow_run.parameters or {}
    return load_config(
        p.get("config_path"), run_options(p.get("config_path"), p.get("overrides"), p.get("dataset_uri"))
    )


def stop_ray_job(flow_run, why: str) -> str | None:
    """Stop the Ray job of this flow run's current attempt if it still runs; returns its submission id."""
    from tasks.cluster import _reachable, jobs_client

    log = run_logger()
    try:
        cfg = _config_of(flow_run)
    except (ConfigError, OSError):
        return None  # it never got as far as a job
    reg = registry.load(cfg.storage, cfg.name)
    if not reg or not reg.get("attempts"):
        return None
    attempt = registry.current_attempt(reg)
    sid, address = attempt["submission_id"], reg["cluster"]["address"]
    if _reachable(address) is not None:
        return None
    client = jobs_client(address)
    try:
        if client.get_job_status(sid).is_terminal():
            return None
        client.stop_job(sid)
    except RuntimeError:  # no such job
        return None
    deadline = time.monotonic() + 30
    while not client.get_job_status(sid).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    log.warning("flow run %s %s: stopped Ray job %s", flow_run.name, why, sid)
    return sid


def stop_on_cancel(flow, flow_run, state) -> None:
    """``on_cancellation``: stop the job; the run ends ``failed`` (cancelled), so no watchdog restarts it."""
    stop_ray_job(flow_run, "was cancelled")
    with contextlib.suppress(Exception):
        cfg = _config_of(flow_run)
        reg = registry.load(cfg.storage, cfg.name)
        if reg and reg.get("attempts"):
            attempt = registry.current_attempt(reg)["attempt"]
            registry.end_attempt(cfg, attempt, "STOPPED", f"flow run {flow_run.name} was cancelled")


def stop_on_crash(flow, flow_run, state) -> None:
    """``on_crashed``: the flow's process died, so nothing watches the job any more. Stop it and hand the run to
    the watchdog (which the crash also triggers), which restarts it from the newest valid checkpoint."""
    sid = stop_ray_job(flow_run, "crashed")
    with contextlib.suppress(Exception):
        cfg = _config_of(flow_run)
        reg = registry.load(cfg.storage, cfg.name)
        if reg and reg.get("attempts"):
            entry = registry.current_attempt(reg)
            incident = {"kind": "flow-crashed", "detected_by": "finetune-flow", "detected_at": time.time(),
                        "attempt": entry["attempt"], "failed_step": None, "last_progress_at": entry["started_at"],
                        "detail": f"flow run {flow_run.name} crashed: {state.message or ''}"[:300],
                        "error": None, "stopped_job": sid}  # fmt: skip
            registry.hand_over(cfg, entry["attempt"], incident["detail"], incident)
