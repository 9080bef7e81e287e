"""The watchdog's work on one run, as a reconciler: ``observe`` (only reads: the job's status, its heartbeat, the
cluster's health) -> ``decide`` (pure: the record as it should be, and what to do) -> ``act`` (thin: each side
effect in order, under the run's lease, a restart re-checked right before it happens).

Ray Train restarts workers inside a job; it cannot restart its own driver, notice a hang, or bring back a cluster.
This does, from outside: everything it needs is on shared storage (run record, heartbeat, checkpoints, job specs),
so it can run anywhere that reaches the storage and the Jobs API -- a scheduled Prefect deployment, or
``unbroken watchdog`` on a laptop.
"""

from __future__ import annotations

import time

from control import lease as leases
from control import registry
from control.records.run import Incident
from control.watchdog import metrics
from control.watchdog.act import act as carry_out
from control.watchdog.decide import Outcome, decide, new_incident
from control.watchdog.janitor import janitor
from control.watchdog.observe import Observations, current_heartbeat, job_failure, last_step, observe
from control.watchdog.verdict import Verdict
from ray_jobs.config import Config

__all__ = ["Outcome", "check_run", "failed_job_incident", "janitor", "metrics"]

LEASE_TTL_S = 300.0


def check_run(storage: str, run: str, now: float | None = None) -> Outcome:
    """One look at one run, and whatever it calls for; a run another watchdog holds is skipped."""
    lease = leases.acquire(storage, run, ttl_s=LEASE_TTL_S)
    if lease is None:
        holder = leases.holder(storage, run) or {}
        return Outcome(run, "skipped", f"another watchdog holds its lease ({holder.get('owner', 'just taken')})")
    with lease:
        reg = registry.load(storage, run)
        if reg is None or not reg.active:
            return Outcome(run, "inactive", f"state {reg and reg.state}")
        cfg = reg.cfg()
        decision = decide(reg, observe(reg, cfg, now), cfg)
        metrics.decided(reg, decision.record)  # counted once decided: a restart that then fails was still seen
        outcome = carry_out(decision, cfg, lease)
        metrics.acted(run, outcome.action)
        return outcome


def failed_job_incident(cfg: Config, attempt: int, address: str, failure: Exception) -> Incident:
    """For the finetune flow, whose watch saw its job fail (or its cluster vanish): the incident the watchdog
    would have written."""
    from control.jobs import ClusterLost

    reg = registry.load(cfg.storage, cfg.name)
    reg.attempts = reg.attempts[:attempt]  # the attempt the flow watched is the one the incident is about
    lost = isinstance(failure, ClusterLost)
    error = None if lost else job_failure(address, reg.current.submission_id)
    beat = current_heartbeat(cfg.storage, cfg.name, attempt)
    verdict = Verdict("cluster-unreachable" if lost else "job-failed", str(failure), error, beat)
    obs = Observations(time.time(), heartbeat=beat, error=error, metrics_step=last_step(cfg.storage, cfg.name))
    return new_incident(cfg, reg, verdict, obs, "finetune-flow")
