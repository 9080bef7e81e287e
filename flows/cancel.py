"""What keeps a finetune flow run and its Ray job in step: one active run per series, and no Ray job left
running after its flow run was cancelled or crashed.

Prefect delivers a cancel of a served run by SIGTERM to the run's process (the watch task sees the termination and
stops the job) and then runs ``on_cancellation`` hooks in the serving process, which stop it too (hooks are
best-effort; stopping twice is harmless). A crash (the run's process died) is not a wish to stop: the job trains on
and the watchdog adopts it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from control import registry, series
from control.backends.base import ClusterError
from control.logs import run_logger
from control.tracking import end_tracker_runs
from flows.params import run_config
from ray_jobs.config import Config, ConfigError

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import State

    from control.records.run import Attempt, RunRecord

SLOT_LEASE_S = 60  # a crashed holder's slot frees itself after this long


@contextlib.asynccontextmanager
async def one_run_per_series(series: str) -> AsyncGenerator[None, None]:
    """Hold the global concurrency limit ``unbroken-series-<series>`` (limit 1) for the whole flow run: a second
    run of the series waits for the first (two dataset events queue in order, and the second then sees what the
    first trained) instead of training beside it. A fixed run name is its own series."""
    from prefect import get_client
    from prefect.concurrency.asyncio import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = f"unbroken-series-{series}"
    async with get_client() as client:
        with contextlib.suppress(ObjectAlreadyExists):  # two first runs racing to create it
            await client.upsert_global_concurrency_limit_by_name(name, 1)
    run_logger().info("waiting for concurrency slot %s (one active run per series)", name)
    # The slot only queues flow runs; what guarantees one training job per run is the registry (an active attempt
    # refuses a second one, under the run's storage lease). So a Prefect API outage that stops the slot's lease
    # renewals must not cancel a flow whose job trains fine: renewal failures are logged, not raised.
    slot = concurrency(name, occupy=1, strict=True, lease_duration=SLOT_LEASE_S, raise_on_lease_renewal_failure=False)
    await slot.__aenter__()
    try:
        yield
    finally:
        try:
            await slot.__aexit__(None, None, None)
        except Exception as e:  # the server may be away; the slot's lease then runs out by itself
            run_logger().warning("could not release concurrency slot %s: %s", name, e)


def _current_attempt(flow_run: FlowRun) -> tuple[Config, RunRecord, Attempt] | None:
    """(config, registry record, attempt) of the attempt this flow run started, or None when it never got as far as
    one -- a second flow run of the same run name (a queued duplicate waiting on the series' slot) has none, and its
    cancel or crash must never touch the first one's job or record."""
    try:
        cfg = run_config(**(flow_run.parameters or {}))
    except (ConfigError, OSError):
        return None
    if cfg.is_template:  # resolved after staging: the series registry knows what this flow run named its run
        run = series.run_of_flow_run(cfg.storage, cfg.series_name, str(flow_run.id))
        if run is None:
            return None
        cfg = cfg.named(run)
    reg = registry.load(cfg.storage, cfg.name)
    if reg is None:
        return None
    attempt = registry.attempt_of_flow_run(reg, str(flow_run.id))
    return None if attempt is None else (cfg, reg, attempt)


def stop_ray_job(flow_run: FlowRun, why: str) -> str | None:
    """Stop the Ray job of this flow run's current attempt if it still runs, and its run host if one is left (where
    its driver could not stop it, being dead already: a host never trains on unwatched); returns the job's
    submission id when something was stopped."""
    from control.backends import handle_from_record
    from control.jobs import stop_and_wait
    from control.runhost import stop_run_host

    found = _current_attempt(flow_run)
    if found is None:
        return None
    cfg, reg, attempt = found
    sid = attempt.submission_id
    assert reg.cluster is not None, "an attempt is recorded with its cluster, in one write (registry._begin)"
    try:
        stopped = stop_and_wait(reg.cluster.url(), sid, wait_s=30)
        host = stop_run_host(cfg, handle_from_record(reg.recorded_cluster), attempt.attempt, wait_s=30)
    except ClusterError as e:
        run_logger().warning("flow run %s %s: %s", flow_run.name, why, e)
        return sid
    if host:
        run_logger().warning("flow run %s %s: stopped the run host of attempt %d", flow_run.name, why, attempt.attempt)
    if not stopped and not host:
        return None
    if stopped:
        run_logger().warning("flow run %s %s: stopped Ray job %s", flow_run.name, why, sid)
    return sid


def stop_on_cancel(flow: Flow[..., Any], flow_run: FlowRun, state: State) -> None:
    """``on_cancellation``: stop the job; the run ends ``failed`` (cancelled), so no watchdog restarts it."""
    stop_ray_job(flow_run, "was cancelled")
    with contextlib.suppress(Exception):
        if found := _current_attempt(flow_run):
            cfg, _, attempt = found
            if registry.end_attempt(cfg, attempt.attempt, "STOPPED", f"flow run {flow_run.name} was cancelled") is None:
                return  # its attempt was already over (the watchdog restarted the run): nothing of it to end
            end_tracker_runs(cfg, "KILLED", f"flow run {flow_run.name} was cancelled")
            if cfg.tune is not None:  # a search: its trials went with its driver
                series.end_unfinished(cfg.storage, cfg.name, f"its search's flow run {flow_run.name} was cancelled")


def stop_on_crash(flow: Flow[..., Any], flow_run: FlowRun, state: State) -> None:
    """``on_crashed``: the flow's process died, so nothing in it watches the job any more. The job itself is fine:
    it trains on, and the watchdog (triggered by this crash, or on its schedule) adopts it -- the attempt belongs
    to the run's registry, not to a flow process. Recorded so the watchdog also closes what the flow would have
    (the run's local head)."""
    with contextlib.suppress(Exception):
        if found := _current_attempt(flow_run):
            cfg, _, attempt = found
            registry.adopt(cfg, attempt.attempt, f"flow run {flow_run.name} crashed: {state.message or ''}")
            run_logger().warning(
                "flow run %s crashed; its Ray job %s is left to the watchdog", flow_run.name, attempt.submission_id
            )
