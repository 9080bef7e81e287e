"""The watchdog's work on one run, as a reconciler: ``observe`` (only reads: the job's status, its heartbeat, the
cluster's health) -> ``decide`` (pure: the record as it should be, and what to do) -> ``act`` (thin: each side
effect in order, under the run's lease). A restart is looked at again right before it happens and decided again on
that look (``decide.recheck``): the pass observes, decides and acts once more.

Ray Train restarts workers inside a job; it cannot restart its own driver, notice a hang, or bring back a cluster.
This does, from outside: everything it needs is on shared storage (run record, heartbeat, checkpoints, job specs),
so it can run anywhere that reaches the storage and the Jobs API -- a scheduled Prefect deployment, or
``unbroken watchdog`` on a laptop.
"""

from __future__ import annotations

import time

from control import lease as leases
from control import registry
from control.backends import recorded_backend
from control.records.run import Incident
from control.watchdog import metrics
from control.watchdog.act import act as carry_out
from control.watchdog.decide import Outcome, Restart, decide, new_incident, recheck
from control.watchdog.janitor import janitor
from control.watchdog.observe import Observations, heartbeat_seen, job_failure, last_step, look, observe
from control.watchdog.verdict import Verdict
from ray_jobs.config import Config, ConfigError
from ray_jobs.contracts.base import RecordError
from ray_jobs.storage import StorageFull

__all__ = ["Outcome", "check_run", "failed_job_incident", "janitor", "left_alone", "metrics", "storage_error"]

LEASE_TTL_S = 300.0
_SAID: set[tuple[str, str]] = set()  # (run, why) already logged by this process: said once, not every pass


def check_run(storage: str, run: str, now: float | None = None) -> Outcome:
    """One look at one run, and whatever it calls for. A run another watchdog holds is skipped; one whose record
    this release cannot read, whose storage does not answer, or whose local head runs on another host is left alone
    with an outcome that says why -- never an exception that would keep the pass from the other runs."""
    try:
        return _check(storage, run, now)
    except (RecordError, ConfigError) as e:
        return left_alone(Outcome(run, "unreadable", f"skipped: {e}"), "error")
    except leases.LeaseLost as e:
        outcome = Outcome(run, "lease-lost", str(e))
    except Exception as e:
        if (kind := storage_error(e)) is None:
            raise
        outcome = Outcome(run, kind, f"{type(e).__name__}: {e}")
    metrics.acted(run, outcome.action)
    return outcome


def _check(storage: str, run: str, now: float | None) -> Outcome:
    reg = registry.load(storage, run)  # a first look without the lease: is it ours to act on at all?
    if reg is None or not reg.watched:
        return Outcome(run, "inactive", f"state {reg and reg.state}")
    if reg.cluster is not None and (where := recorded_backend(reg.cluster).elsewhere(reg.cluster)):
        return left_alone(Outcome(run, "elsewhere", where), "warning")
    lease = leases.acquire(storage, run, ttl_s=LEASE_TTL_S)
    if lease is None:
        holder = leases.holder(storage, run) or {}
        return Outcome(run, "skipped", f"another watchdog holds its lease ({holder.get('owner', 'just taken')})")
    with lease:
        reg = registry.load(storage, run)
        if reg is None or not reg.watched:
            return Outcome(run, "inactive", f"state {reg and reg.state}")
        cfg = reg.cfg()
        decision = decide(reg, observe(reg, cfg, now), cfg)
        metrics.decided(reg, decision.record)  # counted once decided: a restart that then fails was still seen
        outcome = carry_out(decision, cfg, lease)
        if any(isinstance(a, Restart) for a in decision.actions):  # decided maybe a backoff ago: look again first
            reg = decision.record
            outcome = carry_out(recheck(reg, look(cfg, reg, time.time()), cfg), cfg, lease)
        metrics.acted(run, outcome.action)
        return outcome


def left_alone(outcome: Outcome, level: str) -> Outcome:
    """Log why a run is left alone once per process (a watchdog loop would repeat it every pass); count it every
    pass."""
    from control.logs import run_logger

    key = (outcome.run, outcome.detail)
    if key not in _SAID:
        _SAID.add(key)
        getattr(run_logger(), level)("run %s: %s", outcome.run, outcome.detail)
    metrics.acted(outcome.run, outcome.action)
    return outcome


def storage_error(e: BaseException) -> str | None:
    """``storage-full`` or ``storage-unreachable`` when ``e`` is the storage failing (a full disk; a path, bucket or
    endpoint that does not answer), else None. Named as such, it is never taken for the run's trouble: a job whose
    heartbeat the storage could not keep fresh is confirmed stalled only once the storage is back."""
    if isinstance(e, StorageFull):
        return "storage-full"
    module = type(e).__module__.split(".")[0]
    if module in ("requests", "urllib3"):  # the Jobs API's transport (an OSError too): never the storage
        return None
    if isinstance(e, (OSError, TimeoutError)) or module in ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec"):
        return "storage-unreachable"
    return None


def failed_job_incident(cfg: Config, attempt: int, address: str, failure: Exception) -> Incident:
    """For the finetune flow, whose watch saw its job fail (or its cluster vanish): the incident the watchdog
    would have written."""
    from control.jobs import ClusterLost

    reg = registry.load_existing(cfg.storage, cfg.name)  # the flow recorded the attempt it watched
    reg.attempts = reg.attempts[:attempt]  # the attempt the flow watched is the one the incident is about
    lost = isinstance(failure, ClusterLost)
    error = None if lost else job_failure(address, reg.current.submission_id)
    beat, age = heartbeat_seen(cfg.storage, cfg.name, attempt)
    verdict = Verdict("cluster-unreachable" if lost else "job-failed", str(failure), error, beat)
    obs = Observations(
        time.time(), heartbeat=beat, error=error, metrics_step=last_step(cfg.storage, cfg.name), beat_age_s=age
    )
    return new_incident(cfg, reg, verdict, obs, "finetune-flow")
