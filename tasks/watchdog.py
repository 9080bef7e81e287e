"""The watchdog's work on one run: look (job status, cluster, heartbeat), decide (restart policy), act (restart).

Ray Train restarts workers inside a job; it cannot restart its own driver, notice a hang, or bring back a cluster.
This does, from outside: everything it needs is on shared storage (registry, heartbeat, checkpoints, job specs),
so it can run anywhere that reaches the storage and the Jobs API -- a scheduled Prefect deployment, or
``unbroken watchdog`` on a laptop.

Every action on a run happens under the run's storage lease (tasks/lease.py): two watchdogs never both restart it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, from_json
from ray_jobs.storage import Layout, exists, read_json
from tasks import lease as leases
from tasks import registry
from tasks.cluster import _reachable, jobs_client, provision_cluster, stop_cluster
from tasks.jobs import last_step, stop_and_wait, submit_job, write_job_spec
from tasks.logs import run_logger

# Exceptions that say the code or the config is wrong: the same job would fail the same way again.
USER_ERRORS = frozenset(
    {
        "ConfigError", "ValidationError", "RunConflict", "CheckpointInvalid", "SyntaxError", "ImportError",
        "ModuleNotFoundError", "NameError", "AttributeError", "TypeError", "KeyError", "IndexError", "ValueError",
        "AssertionError", "NotImplementedError", "ZeroDivisionError", "UnicodeDecodeError", "OutOfMemoryError",
    }
)  # fmt: skip
# Two failures in a row at the same step with the same error: deterministic, not bad luck.
SAME_FAILURE_LIMIT = 2
LEASE_TTL_S = 300.0
STOP_WAIT_S = 60.0


@dataclass
class Verdict:
    """What the watchdog sees for the current attempt."""

    kind: str  # running | succeeded | job-failed | stalled | cluster-unreachable | job-lost
    detail: str = ""
    error: dict[str, str] | None = None  # root cause the job printed (type, message)
    heartbeat: dict[str, Any] | None = None  # the current attempt's heartbeat, if it wrote one
    status: str = ""

    @property
    def trouble(self) -> bool:
        return self.kind not in ("running", "succeeded")


@dataclass
class Outcome:
    run: str
    action: str  # ok | succeeded | restarted | waiting | gave-up | skipped | inactive
    detail: str = ""
    incident: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "action": self.action, "detail": self.detail, "incident": self.incident}


# -- look ---------------------------------------------------------------------------------------------------
def current_heartbeat(storage: str, run: str, attempt: int) -> dict[str, Any] | None:
    """The heartbeat file if the given attempt wrote it (an older attempt's says nothing about this one)."""
    try:
        beat = read_json(Layout(storage).heartbeat(run))
    except (FileNotFoundError, ValueError):
        return None
    return beat if beat.get("attempt") == attempt else None


def job_failure(client, sid: str) -> dict[str, str] | None:
    """The root cause ``ray_jobs.job`` printed when training raised (None when the driver died without a word)."""
    try:
        logs = client.get_job_logs(sid)
    except Exception:
        return None
    lines = [ln for ln in logs.splitlines() if ln.startswith("UNBROKEN_FAILURE ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def inspect(reg: dict[str, Any], cfg: Config, now: float) -> Verdict:
    """Classify the current attempt: healthy, done, or which kind of trouble."""
    from ray.job_submission import JobStatus

    address = reg["cluster"]["address"]
    attempt = registry.current_attempt(reg)
    sid = attempt["submission_id"]
    beat = current_heartbeat(cfg.storage, cfg.name, attempt["attempt"])  # storage outlives the cluster
    why = _reachable(address)
    if why is not None:
        return Verdict("cluster-unreachable", f"the Jobs API at {address} does not answer: {why}", heartbeat=beat)
    client = jobs_client(address)
    try:
        info = client.get_job_info(sid)
    except RuntimeError as e:  # 404: a restarted cluster has no record of the job
        if still_submitting(attempt, cfg, now):
            return Verdict("running", status="SUBMITTING", heartbeat=beat)
        detail = f"the cluster at {address} has no job {sid} ({str(e).splitlines()[0]})"
        return Verdict("job-lost", detail, heartbeat=beat)
    status = str(info.status)
    if info.status == JobStatus.SUCCEEDED:
        return Verdict("succeeded", status=status, heartbeat=beat)
    if info.status in (JobStatus.FAILED, JobStatus.STOPPED):
        error = job_failure(client, sid)
        detail = f"Ray job {sid} ended {status}: {info.message or ''}".strip()
        if error:
            detail += f" [{error['type']}: {error['message']}]"
        return Verdict("job-failed", detail, error=error, heartbeat=beat, status=status)
    # PENDING or RUNNING: moving, or hung? Before its first heartbeat an attempt is measured from its submission.
    since = max(attempt["started_at"], beat["last_step_at"] if beat else 0.0)
    quiet = now - since
    if quiet > cfg.fault_tolerance.stall_timeout_s:
        at = f"at step {beat['step']}" if beat else "before its first step"
        return Verdict(
            "stalled",
            f"Ray job {sid} is {status} but made no step for {quiet:.0f}s {at} "
            f"(fault_tolerance.stall_timeout_s={cfg.fault_tolerance.stall_timeout_s:g})",
            heartbeat=beat,
            status=status,
        )
    return Verdict("running", status=status, heartbeat=beat)


def still_submitting(attempt: dict[str, Any], cfg: Config, now: float) -> bool:
    """Whether a job the cluster does not know may simply not be submitted yet. An attempt is recorded before its
    job reaches the cluster (the flow writes the job spec and runs the preflight job first), so a 404 then is not a
    lost job; it is one only when the attempt was never seen running and its submitter took longer than the stall
    limit, the same wait a job gets before its first step."""
    return attempt["status"] == "SUBMITTED" and now - attempt["started_at"] < cfg.fault_tolerance.stall_timeout_s


# -- decide -------------------------------------------------------------------------------------------------
def backoff_s(cfg: Config, restarts_done: int) -> float:
    """Wait before restart number ``restarts_done + 1``: base, 2x base, 4x base ... capped."""
    ft = cfg.fault_tolerance
    return min(ft.restart_backoff_s * 2**restarts_done, ft.restart_backoff_max_s)


def give_up_reason(reg: dict[str, Any], cfg: Config, incident: dict[str, Any]) -> str | None:
    """Why restarting again would be pointless or not allowed; None when a restart is in order."""
    done, budget = reg.get("restarts", 0), cfg.fault_tolerance.max_restarts
    error = incident.get("error") or {}
    if USER_ERRORS.intersection(error.get("kinds") or [error.get("type")]):
        return (
            f"the job raised {error['type']}: {error.get('message', '')} -- an error in the code, data or config, "
            "which a restart would repeat"
        )
    past = [i for i in reg.get("incidents", []) if i is not incident and i.get("action") == "restarted"]
    same = [i for i in past[-(SAME_FAILURE_LIMIT - 1) :] if _same_failure(i, incident)]
    if incident.get("failed_step") is not None and len(same) == SAME_FAILURE_LIMIT - 1:
        return (
            f"deterministic failure: {SAME_FAILURE_LIMIT} attempts in a row failed at step {incident['failed_step']} "
            f"({incident['kind']}{': ' + error['type'] if error else ''}); a restart would fail the same way"
        )
    if done >= budget:
        return f"restart budget exhausted: {done} of fault_tolerance.max_restarts={budget} restarts used"
    return None


def _same_failure(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.get("failed_step") == b.get("failed_step")
        and a.get("kind") == b.get("kind")
        and (a.get("error") or {}).get("type") == (b.get("error") or {}).get("type")
    )


# -- act ----------------------------------------------------------------------------------------------------
def check_run(storage: str, run: str, now: float | None = None) -> Outcome:
    """One look at one run, and whatever it calls for; a run another watchdog holds is skipped."""
    lease = leases.acquire(storage, run, ttl_s=LEASE_TTL_S)
    if lease is None:
        holder = leases.holder(storage, run) or {}
        return Outcome(run, "skipped", f"another watchdog holds its lease ({holder.get('owner', 'just taken')})")
    with lease:
        reg = registry.load(storage, run)
        if reg is None or reg.get("state") not in registry.ACTIVE:
            return Outcome(run, "inactive", f"state {reg and reg.get('state')}")
        return _check(storage, run, reg, lease, time.time() if now is None else now)


def _check(storage: str, run: str, reg: dict[str, Any], lease: leases.Lease, now: float) -> Outcome:
    log = run_logger()
    cfg = from_json(json.dumps(reg["config"]))
    incident = registry.open_incident(reg)
    if incident is None:
        verdict = inspect(reg, cfg, now)
        if verdict.kind == "running":
            changed = _note_progress(reg, verdict.heartbeat)
            if verdict.status == "RUNNING":
                changed |= registry.set_running(reg, registry.current_attempt(reg)["attempt"])
            if changed:  # a healthy run costs no write per pass
                registry.save(storage, run, reg)
            step = verdict.heartbeat["step"] if verdict.heartbeat else "-"
            return Outcome(run, "ok", f"{verdict.status}, step {step}")
        if verdict.kind == "succeeded":
            return _finish(cfg, reg, verdict)
        incident = _open(cfg, reg, verdict, now)
        registry.save(storage, run, reg)
        log.warning("run %s: %s detected: %s", run, incident["kind"], verdict.detail)
    reason = give_up_reason(reg, cfg, incident)
    if reason is not None:
        return _give_up(cfg, reg, incident, reason)
    due = incident["detected_at"] + backoff_s(cfg, reg.get("restarts", 0))
    if now < due:
        incident.update(action="waiting", next_restart_at=due)
        registry.save(storage, run, reg)
        return Outcome(run, "waiting", f"restart in {due - now:.0f}s (backoff)", incident)
    return _restart(cfg, reg, incident, lease)


def new_incident(
    cfg: Config, attempt: dict[str, Any], verdict: Verdict, now: float, detected_by: str = "watchdog"
) -> dict[str, Any]:
    """An incident record for trouble with ``attempt``: what, when, and how far the attempt had got."""
    beat = verdict.heartbeat
    failed_step = max(
        beat["step"] if beat else _resumed_step(attempt), last_step(Layout(cfg.storage).metrics(cfg.name))
    )
    last_progress = beat["last_step_at"] if beat else attempt["started_at"]
    return {
        "kind": verdict.kind,
        "detected_by": detected_by,
        "detected_at": now,
        "attempt": attempt["attempt"],
        "failed_step": failed_step,
        "last_progress_at": last_progress,
        "silent_s": round(now - last_progress, 3),
        "detail": _first_line(verdict.detail),
        "error": verdict.error,
    }


def _open(cfg: Config, reg: dict[str, Any], verdict: Verdict, now: float) -> dict[str, Any]:
    """Record the incident and end the current attempt; the run is ``recovering`` from here."""
    attempt = registry.current_attempt(reg)
    incident = new_incident(cfg, attempt, verdict, now)
    attempt.update(status={"job-failed": "FAILED", "stalled": "STALLED"}.get(verdict.kind, "LOST"),
                   ended_at=now, message=incident["detail"])  # fmt: skip
    reg.setdefault("incidents", []).append(incident)
    reg["state"] = "recovering"
    return incident


def failed_job_incident(cfg: Config, attempt: int, address: str, failure: Exception) -> dict[str, Any]:
    """For the finetune flow, whose watch saw its job fail (or its cluster vanish): the incident the watchdog
    would have written."""
    from tasks.jobs import ClusterLost

    reg = registry.load(cfg.storage, cfg.name)
    entry = reg["attempts"][attempt - 1]
    lost = isinstance(failure, ClusterLost)
    error = None if lost else job_failure(jobs_client(address), entry["submission_id"])
    beat = current_heartbeat(cfg.storage, cfg.name, attempt)
    verdict = Verdict("cluster-unreachable" if lost else "job-failed", str(failure), error, beat)
    return new_incident(cfg, entry, verdict, time.time(), "finetune-flow")


def _first_line(text: str) -> str:
    """Ray's job message carries up to 20,000 characters of log; the registry keeps the headline."""
    return (text.strip().splitlines() or [""])[0][:300]


def _resumed_step(attempt: dict[str, Any]) -> int:
    return ckpt.checkpoint_step(attempt["resume_from"]) if attempt.get("resume_from") else 0


def _restart(cfg: Config, reg: dict[str, Any], incident: dict[str, Any], lease: leases.Lease) -> Outcome:
    """Stop what is left, re-provision if needed, resume from the newest valid checkpoint under a new submission."""
    log = run_logger()
    run, storage = cfg.name, cfg.storage
    old = registry.current_attempt(reg)
    _stop_leftovers(reg["cluster"]["address"], old["submission_id"])
    lease.renew()
    handle = provision_cluster(cfg)  # the finetune flow's task: starts a local head again if it is gone
    lease.renew()
    found = ckpt.find_latest_valid(Layout(storage).checkpoints_dir(run))
    resume_from = found[0] if found else None
    resumed_step = ckpt.checkpoint_step(resume_from) if resume_from else 0
    # Steps lost: trained before the failure, to be trained again. The failed attempt's progress is known to
    # the heartbeat/metrics cadence (the watchdog only sees what was written).
    incident["lost_steps"] = max(0, (incident.get("failed_step") or 0) - resumed_step)
    lease.check()  # fencing: never submit on a lease another watchdog has taken over
    # begin_attempt re-reads the registry: write ours (the incident) first, then let it append the attempt.
    registry.save(storage, run, reg)
    owned = handle.started_here or (reg["cluster"].get("started_here") and reg["cluster"]["address"] == handle.address)
    attempt = registry.begin_attempt(
        cfg,
        {"address": handle.address, "started_here": owned},
        reg["dataset_id"],
        resume_from=resume_from,
        started_by="watchdog",
        extra={"manifest_url": reg["manifest_url"], "model_path": reg["model_path"]},
    )
    spec = write_job_spec(cfg, attempt, reg["manifest_url"], reg["model_path"], resume_from)
    sid = submit_job(handle, registry.submission_id(run, attempt), spec)
    reg = registry.load(storage, run)
    incident = registry.open_incident(reg)
    incident.update(
        action="restarted",
        new_attempt=attempt,
        submission_id=sid,
        resumed_from=resume_from,
        resumed_step=resumed_step if resume_from else None,
        restarted_at=time.time(),
        reprovisioned=handle.started_here,
    )
    reg["restarts"] = reg.get("restarts", 0) + 1
    reg["state"] = "submitted"
    registry.save(storage, run, reg)
    where = f"checkpoint at step {resumed_step}" if resume_from else "scratch (no valid checkpoint yet)"
    log.warning("run %s: restarted as attempt %d (%s) from %s; %d steps lost", run, attempt, sid, where,
                incident["lost_steps"])  # fmt: skip
    return Outcome(run, "restarted", f"attempt {attempt} from {where}", incident)


def _stop_leftovers(address: str, sid: str) -> None:
    """Stop the failed attempt's job if the cluster still runs it, and wait until Ray says it ended."""
    if stop_and_wait(address, sid, STOP_WAIT_S):
        run_logger().info("stopped what was left of Ray job %s", sid)


def _note_progress(reg: dict[str, Any], beat: dict[str, Any] | None) -> bool:
    """Complete the last restart's incident once its attempt has trained a step: the time to recover.
    True when the record changed."""
    if not beat or not beat.get("first_step_at"):
        return False
    for inc in reversed(reg.get("incidents", [])):
        if inc.get("action") == "restarted" and inc.get("new_attempt") == beat.get("attempt"):
            if inc.get("first_new_step_at") is not None:
                return False
            inc["first_new_step_at"] = beat["first_step_at"]
            inc["time_to_recover_s"] = round(beat["first_step_at"] - inc["detected_at"], 3)
            inc["downtime_s"] = round(beat["first_step_at"] - inc["last_progress_at"], 3)
            return True
    return False


def _finish(cfg: Config, reg: dict[str, Any], verdict: Verdict) -> Outcome:
    """The job succeeded: close the run; stop a local head that a watchdog restart started, unless kept."""
    _note_progress(reg, verdict.heartbeat)
    attempt = registry.current_attempt(reg)
    attempt.update(status="SUCCEEDED", ended_at=attempt.get("ended_at") or time.time())
    reg["state"] = "succeeded"
    final = Layout(cfg.storage).final_model(cfg.name)
    if exists(final):
        reg["final_model"] = final
    registry.save(cfg.storage, cfg.name, reg)
    cluster = reg["cluster"]
    if attempt.get("started_by") == "watchdog" and cluster.get("started_here") and not cfg.cluster.keep_running:
        from tasks.cluster import ClusterHandle

        stop_cluster(ClusterHandle(cluster["address"], cluster["address"], True, ""))
    return Outcome(cfg.name, "succeeded", f"final model: {reg.get('final_model', '-')}")


def _give_up(cfg: Config, reg: dict[str, Any], incident: dict[str, Any], reason: str) -> Outcome:
    _stop_leftovers(reg["cluster"]["address"], registry.current_attempt(reg)["submission_id"])
    incident.update(action="gave-up", reason=reason, gave_up_at=time.time())
    reg.update(state="failed", reason=reason)
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().error("run %s: giving up: %s", cfg.name, reason)
    return Outcome(cfg.name, "gave-up", reason, incident)
