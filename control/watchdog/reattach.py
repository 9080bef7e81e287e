"""The watchdog's re-attach: the current attempt's job driver died while its run host trains on
(``fault_tolerance.run_host``, ray_jobs/host.py) -- a new driver for the same attempt finds the host by its name and
waits on it, relaying its end as the first would have. Nothing restarts and nothing is counted: the attempt carries
on under its new driver's submission id, its earlier ones kept (``Attempt.drivers``). A host that is gone by then
makes the new driver fail at once, naming it (``RunHostGone``): the next look restarts the run as for any failed
job."""

from __future__ import annotations

from dataclasses import replace

from control import jobsapi, registry
from control import lease as leases
from control.backends import backend_for
from control.backends.base import ClusterHandle
from control.jobcode import entrypoint, user_code
from control.jobs import submit
from control.jobsapi import JobView
from control.logs import run_logger
from control.records.run import RunRecord
from control.watchdog import credentials
from control.watchdog.observe import heartbeat_seen, job_failure, recorded_handle
from control.watchdog.verdict import driver_dead, hosted
from ray_jobs.config import Config
from ray_jobs.storage import Layout


def reattach(cfg: Config, reg: RunRecord, lease: leases.Lease) -> str:
    """Submit a driver that re-attaches to the current attempt's run host and record it; its submission id."""
    attempt = reg.current
    base = registry.submission_id(cfg.storage, cfg.name, attempt.attempt)
    sid = f"{base}-d{len(attempt.drivers) + 2}"  # the attempt's second driver is -d2
    env = credentials.for_resubmission(reg)
    code = user_code(cfg, lambda: jobsapi.job_user_code(reg.recorded_cluster.url(), attempt.submission_id))
    spec = Layout(cfg.storage).job_spec(cfg.name, attempt.attempt)
    lease.check()  # fenced: a watchdog that lost its lease submits nothing
    with lease.kept():
        handle = replace(recorded_handle(reg), python=cfg.cluster.python)  # the interpreter is the config's
        submit(handle, sid, entrypoint(cfg), spec, env, flags=("--attach",), code=code)
    attempt.set(drivers=[*attempt.drivers, attempt.submission_id], submission_id=sid, status="SUBMITTED")
    attempt.unset("ended_at")
    lease.check()
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().warning(
        "run %s: attempt %d's driver %s is gone while its run host trains on: re-attached as %s",
        cfg.name,
        attempt.attempt,
        attempt.drivers[-1],
        sid,
    )
    return sid


def driver_lost(cfg: Config, reg: RunRecord) -> bool:
    """One look (the Jobs API, the job's log or where its driver ran, the heartbeat): did the current attempt's
    driver die while its run host trains on? What the watchdog's verdict ``driver-lost`` says, for the finetune
    flow's watch."""
    address, sid = reg.recorded_cluster.url(), reg.current.submission_id
    view = jobsapi.read_job(address, sid)
    error = job_failure(address, sid) if view.status == "FAILED" else None
    dead = driver_gone(cfg, recorded_handle(reg), view)
    beat, age = heartbeat_seen(cfg.storage, cfg.name, reg.current.attempt)
    return hosted(view, beat, cfg, age, error, driver_dead=dead)


def driver_gone(cfg: Config, handle: ClusterHandle, view: JobView) -> bool:
    """A running job whose driver's node the cluster lists dead (a head restarted under GCS fault tolerance keeps
    such a job RUNNING: :func:`~control.watchdog.verdict.driver_dead`); asked of its nodes only then."""
    if not cfg.hosted or view.status != "RUNNING" or not view.driver_node:
        return False
    return driver_dead(view, backend_for(cfg).health(handle))


def reattach_watched(cfg: Config, attempt: int, watched: str) -> str | None:
    """The finetune flow's watch saw its job (``watched``: its submission id) end FAILED: when its driver died while
    its run host trains on, a driver re-attaches -- under the run's lease, and only while ``attempt`` is still the
    run's current attempt in flight -- and its submission id is returned for the watch to go on with (the one a
    watchdog re-attached first, if it did); None otherwise (a failure, to hand over)."""
    if not cfg.hosted:
        return None
    with leases.acquire_wait(cfg.storage, cfg.name) as lease:
        reg = registry.load_existing(cfg.storage, cfg.name)
        if len(reg.attempts) != attempt or not reg.current.in_flight:
            return None
        if reg.current.submission_id != watched:  # a watchdog re-attached a driver first: watched on
            return reg.current.submission_id
        return reattach(cfg, reg, lease) if driver_lost(cfg, reg) else None
