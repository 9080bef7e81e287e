"""The watchdog's eyes: everything one pass over a run reads, and nothing else it does. What the Jobs API says about
the current attempt's job, the job's heartbeat, the root cause a failed job printed, how far its metrics got, and
the cluster's health while the job runs -- each read only when the look so far makes it matter."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from control import jobsapi
from control.backends import backend_for, handle_from_record
from control.backends.base import ClusterHandle
from control.backends.health import Health, disk_usage
from control.records.run import RunRecord
from control.series.search import final_model
from control.watchdog.verdict import classify, driver_dead, fresh_s
from ray_jobs.config import Config
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.coordination import modified_at, storage_now
from ray_jobs.storage import Layout
from ray_jobs.train.metrics import MetricsTail


@dataclass(frozen=True)
class Observations:
    """One pass's reads. ``job`` is None when nothing was asked of the cluster (an incident is already open)."""

    now: float
    job: jobsapi.JobView | None = None
    heartbeat: Beat | None = None
    error: JobFailure | None = None  # the root cause a FAILED/STOPPED job printed
    metrics_step: int = 0  # newest step in the metrics log (read only when the attempt is in trouble)
    health: Health | None = None  # the cluster's nodes (read only while the job runs)
    disk: tuple[int, int] | None = None  # free/total bytes of a local storage path
    final_model: str | None = None  # the run's final model folder (a search's: its winner's), once the job succeeded
    beat_age_s: float | None = None  # the heartbeat's age by the storage's clock (None: judged by its own ``time``)
    job_gone: bool | None = None  # the backend's evidence that no process of the job is left (asked when the API fails)
    driver_dead: bool = False  # the cluster lists the node of the running job's driver dead (verdict.driver_dead)


def current_heartbeat(storage: str, run: str, attempt: int) -> Beat | None:
    """The heartbeat file if the given attempt wrote it (an older attempt's says nothing about this one)."""
    return heartbeat_seen(storage, run, attempt)[0]


def heartbeat_seen(storage: str, run: str, attempt: int) -> tuple[Beat | None, float | None]:
    """(the given attempt's heartbeat, its age in seconds by the storage's clock), or (None, None) when the attempt
    wrote none (or it cannot be read as one: torn, hand-edited, or a newer release's, RecordError -- never judged
    by a guess at its fields). The age compares the storage's stamp on the file with the storage's
    now: the watchdog's clock is never set against the cluster's."""
    url = Layout(storage).heartbeat(run)
    try:
        stamped = modified_at(url)
        beat = Beat.read(url)
    except (FileNotFoundError, ValueError):  # RecordError is a ValueError
        return None, None
    if beat is None or beat.attempt != attempt:
        return None, None
    return beat, max(0.0, storage_now(Layout(storage).probes()) - stamped)


def live_heartbeat(cfg: Config, attempt: int) -> str | None:
    """For the flow's watch: what says the attempt's job still trains (its heartbeat is fresh), or None -- the
    channel that vetoes "the cluster is lost" while only the Jobs API is silent."""
    beat, age = heartbeat_seen(cfg.storage, cfg.name, attempt)
    if beat is None or age is None or age > fresh_s(cfg):  # age is None exactly when beat is
        return None
    return f"its heartbeat is fresh (step {beat.step}, written {age:.0f}s ago)"


def job_failure(address: str, sid: str) -> JobFailure | None:
    """The root cause ``ray_jobs.job`` printed when training raised (None when the driver died without a word, or
    its last failure line cannot be read: no root cause, never a pass that raises)."""
    return JobFailure.last_in(jobsapi.job_logs(address, sid) or "")


def last_step(storage: str, run: str) -> int:
    """Newest step in the run's metrics log (0 when there is none yet)."""
    return MetricsTail(Layout(storage).metrics(run)).last_step()


def observe(reg: RunRecord, cfg: Config, now: float | None = None) -> Observations:
    """Everything ``decide`` needs about the run's current attempt. Nothing is read of the cluster while an incident
    is open: that is decided on the record alone, and the restart looks again right before it acts."""
    now = time.time() if now is None else now
    if reg.open_incident() is not None:
        return Observations(now)
    return look(cfg, reg, now)


def look(cfg: Config, reg: RunRecord, now: float) -> Observations:
    """One look at the current attempt's job: its status and heartbeat, then what that status makes worth reading."""
    address, attempt = reg.recorded_cluster.url(), reg.current
    beat, age = heartbeat_seen(cfg.storage, cfg.name, attempt.attempt)  # storage outlives the cluster
    view = jobsapi.read_job(address, attempt.submission_id)
    ended = view.api == "ok" and view.status in ("FAILED", "STOPPED")
    error = job_failure(address, attempt.submission_id) if ended else None
    gone = job_gone(cfg, reg) if view.api != "ok" else None
    # the cluster's nodes while the job runs: noted, and where its driver ran (a run host outlives a driver's node)
    health = backend_for(cfg).health(recorded_handle(reg)) if view.status == "RUNNING" else None
    dead = driver_dead(view, health)
    verdict = classify(view, attempt, beat, cfg, now, address, error, age, gone, dead)
    seen = Observations(now, view, beat, error, beat_age_s=age, job_gone=gone, driver_dead=dead)
    if verdict.trouble:  # what else is read depends on the verdict (each is a look at storage or the cluster)
        return replace(seen, metrics_step=last_step(cfg.storage, cfg.name))
    if verdict.kind == "succeeded":
        return replace(seen, final_model=final_model(cfg.storage, cfg.name))
    if health is not None:
        return replace(seen, health=health, disk=disk_usage(cfg.storage))
    return seen


def job_gone(cfg: Config, reg: RunRecord) -> bool | None:
    """What the run's backend sees of its current job's processes (None: it cannot see them from here)."""
    if reg.cluster is None:
        return None
    return backend_for(cfg).job_gone(recorded_handle(reg), reg.current.submission_id)


def recorded_handle(reg: RunRecord) -> ClusterHandle:
    """The run's cluster as its record has it (its backend rebuilds the handle)."""
    return handle_from_record(reg.recorded_cluster)
