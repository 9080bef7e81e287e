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

from ray_jobs.config import ConfigError
from tasks import registry
from tasks.cluster import ClusterError
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


def _current_attempt(flow_run):
    """(config, registry record, current attempt) of this flow run's training run, or None when it never got
    as far as an attempt."""
    from flows.finetune import run_config

    try:
        cfg = run_config(**(flow_run.parameters or {}))
    except (ConfigError, OSError):
        return None
    reg = registry.load(cfg.storage, cfg.name)
    if not reg or not reg.get("attempts"):
        return None
    return cfg, reg, registry.current_attempt(reg)


def stop_ray_job(flow_run, why: str) -> str | None:
    """Stop the Ray job of this flow run's current attempt if it still runs; returns its submission id."""
    from tasks.jobs import stop_and_wait

    found = _current_attempt(flow_run)
    if found is None:
        return None
    _, reg, attempt = found
    sid = attempt["submission_id"]
    try:
        stopped = stop_and_wait(reg["cluster"]["address"], sid, wait_s=30)
    except ClusterError as e:
        run_logger().warning("flow run %s %s: %s", flow_run.name, why, e)
        return sid
    if not stopped:
        return None
    run_logger().warning("flow run %s %s: stopped Ray job %s", flow_run.name, why, sid)
    return sid


def stop_on_cancel(flow, flow_run, state) -> None:
    """``on_cancellation``: stop the job; the run ends ``failed`` (cancelled), so no watchdog restarts it."""
    stop_ray_job(flow_run, "was cancelled")
    with contextlib.suppress(Exception):
        if found := _current_attempt(flow_run):
            cfg, _, attempt = found
            registry.end_attempt(cfg, attempt["attempt"], "STOPPED", f"flow run {flow_run.name} was cancelled")


def stop_on_crash(flow, flow_run, state) -> None:
    """``on_crashed``: the flow's process died, so nothing watches the job any more. Stop it and hand the run to
    the watchdog (which the crash also triggers), which restarts it from the newest valid checkpoint."""
    from tasks.watchdog import Verdict, current_heartbeat, new_incident

    sid = stop_ray_job(flow_run, "crashed")
    with contextlib.suppress(Exception):
        if found := _current_attempt(flow_run):
            cfg, _, attempt = found
            detail = f"flow run {flow_run.name} crashed: {state.message or ''}"
            beat = current_heartbeat(cfg.storage, cfg.name, attempt["attempt"])
            incident = new_incident(cfg, attempt, Verdict("flow-crashed", detail, heartbeat=beat), time.time(),
                                    detected_by="finetune-flow") | {"stopped_job": sid}  # fmt: skip
            registry.hand_over(cfg, attempt["attempt"], incident["detail"], incident)
