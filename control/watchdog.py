"""The watchdog's work on one run: look (job status, cluster, heartbeat), decide (restart policy), act (restart).

Ray Train restarts workers inside a job; it cannot restart its own driver, notice a hang, or bring back a cluster.
This does, from outside: everything it needs is on shared storage (registry, heartbeat, checkpoints, job specs),
so it can run anywhere that reaches the storage and the Jobs API -- a scheduled Prefect deployment, or
``unbroken watchdog`` on a laptop.

Every action on a run happens under the run's storage lease (control/lease.py): two watchdogs never both restart it.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from control import jobsapi, registry, series
from control import lease as leases
from control.backends import backend_for, handle_from_record, health, janitor_backends
from control.backends.base import ClusterError, ClusterHandle
from control.backends.janitor import sweep
from control.cluster import provision, release
from control.confirm import Suspicion
from control.jobs import StopUnverified, last_step, stop_and_wait, submit, write_job_spec
from control.logs import run_logger
from control.rayapi import first_line as _first_line
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, from_json
from ray_jobs.storage import Layout, exists, read_json

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
    phase: str = ""  # the job's phase as its heartbeat reports it (``starting`` before the first one)

    @property
    def definitive(self) -> bool:
        return self.kind in DEFINITIVE

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
# Kinds of trouble that are facts (the Jobs API said so; the job's own heartbeat says it is stuck): acted on at once.
DEFINITIVE = ("job-failed", "stalled")
# Kinds that may be a blip of the observer's path (a proxy's 502, a restarting dashboard, an auth hiccup): acted on
# only once they held for fault_tolerance.confirm_s over at least CONFIRM_OBSERVATIONS looks.
AMBIGUOUS = ("cluster-unreachable", "job-lost")
CONFIRM_OBSERVATIONS = 2


def current_heartbeat(storage: str, run: str, attempt: int) -> dict[str, Any] | None:
    """The heartbeat file if the given attempt wrote it (an older attempt's says nothing about this one)."""
    try:
        beat = read_json(Layout(storage).heartbeat(run))
    except (FileNotFoundError, ValueError):
        return None
    return beat if beat.get("attempt") == attempt else None


def job_failure(address: str, sid: str) -> dict[str, Any] | None:
    """The root cause ``ray_jobs.job`` printed when training raised (None when the driver died without a word)."""
    logs = jobsapi.job_logs(address, sid) or ""
    lines = [ln for ln in logs.splitlines() if ln.startswith("UNBROKEN_FAILURE ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def inspect(reg: dict[str, Any], cfg: Config, now: float) -> Verdict:
    """Look at the current attempt once: what the Jobs API says about its job, and its heartbeat."""
    address = reg["cluster"]["address"]
    attempt = registry.current_attempt(reg)
    sid = attempt["submission_id"]
    beat = current_heartbeat(cfg.storage, cfg.name, attempt["attempt"])  # storage outlives the cluster
    view = jobsapi.read_job(address, sid)
    error = job_failure(address, sid) if view.api == "ok" and view.status in ("FAILED", "STOPPED") else None
    return classify(view, attempt, beat, cfg, now, address, error)


def classify(
    view: jobsapi.JobView,
    attempt: dict[str, Any],
    beat: dict[str, Any] | None,
    cfg: Config,
    now: float,
    address: str = "",
    error: dict[str, Any] | None = None,
) -> Verdict:
    """One observation -> a verdict (pure: unit-tested with tables of cases)."""
    sid = attempt["submission_id"]
    if view.api == "unknown":
        return Verdict("cluster-unreachable", f"the Jobs API at {address} gave no answer: {view.why}", heartbeat=beat)
    if view.api == "missing":
        if still_submitting(attempt, cfg, now):
            return Verdict("running", status="SUBMITTING", heartbeat=beat)
        return Verdict("job-lost", view.why, heartbeat=beat)
    if view.status == "SUCCEEDED":
        return Verdict("succeeded", status=view.status, heartbeat=beat)
    if view.status in ("FAILED", "STOPPED"):
        detail = f"Ray job {sid} ended {view.status}: {view.message or ''}".strip()
        if error:
            detail += f" [{error['type']}: {error['message']}]"
        return Verdict("job-failed", detail, error=error, heartbeat=beat, status=view.status)
    return _stall_verdict(view.status, attempt, beat, cfg, now)


def _stall_verdict(
    status: str, attempt: dict[str, Any], beat: dict[str, Any] | None, cfg: Config, now: float
) -> Verdict:
    """PENDING or RUNNING: moving, or hung in its phase? Each phase has its own limit (a multi-GB export is not a
    training step); a heartbeat that stopped refreshing means a frozen or dead process whatever the phase."""
    phase, since, limit, field = phase_clock(attempt, beat, cfg)
    quiet = now - since
    if beat is not None and phase != "training":
        silent = now - beat.get("time", since)
        if silent > cfg.fault_tolerance.stall_timeout_s:  # frozen (SIGSTOP, a dead host) in a long phase
            phase, quiet, limit, field = phase, silent, cfg.fault_tolerance.stall_timeout_s, "stall_timeout_s"
    if quiet <= limit:
        return Verdict("running", status=status, heartbeat=beat, phase=phase)
    at = f"at step {beat['step']}" if beat else "before its first heartbeat"
    what = "made no step" if phase == "training" else f"was in phase {phase!r}"
    return Verdict(
        "stalled",
        f"Ray job {attempt['submission_id']} is {status} but {what} for {quiet:.0f}s {at} "
        f"(fault_tolerance.{field}={limit:g})",
        heartbeat=beat,
        status=status,
        phase=phase,
    )


def phase_clock(attempt: dict[str, Any], beat: dict[str, Any] | None, cfg: Config) -> tuple[str, float, float, str]:
    """(phase, since when, limit in seconds, config field) of the attempt as its heartbeat reports it. No heartbeat
    yet: ``starting``, from the submission. ``training``: from the last step. Older heartbeats have no phase."""
    ft = cfg.fault_tolerance
    if beat is None:
        return "starting", attempt["started_at"], ft.phase_stall_s.starting, "phase_stall_s.starting"
    phase = beat.get("phase", "training")
    if phase == "training":
        since = max(beat["last_step_at"], beat.get("phase_started_at") or 0.0)
        return phase, since, ft.stall_timeout_s, "stall_timeout_s"
    key = "exporting" if phase == "done" else phase  # done: the driver still has to exit
    limit = getattr(ft.phase_stall_s, key, ft.stall_timeout_s)
    return phase, beat.get("phase_started_at") or beat["last_step_at"], limit, f"phase_stall_s.{key}"


def still_submitting(attempt: dict[str, Any], cfg: Config, now: float) -> bool:
    """Whether a job the cluster does not know may simply not be submitted yet (recorded, never seen running, and
    younger than the stall limit). The flow records an attempt only once the run fits its cluster, right before it
    submits, so this window covers the submit call itself."""
    return attempt["status"] == "SUBMITTED" and now - attempt["started_at"] < cfg.fault_tolerance.stall_timeout_s


# -- decide -------------------------------------------------------------------------------------------------
def confirm(reg: dict[str, Any], verdict: Verdict, cfg: Config, now: float) -> str:
    """What this look means given the earlier ones: ``healthy``, ``suspect`` (an ambiguous sign, not confirmed yet)
    or ``trouble`` (act). Keeps the open suspicion in ``reg["suspect"]``; pure apart from that."""
    if not verdict.trouble:
        return "healthy"
    if verdict.definitive:
        return "trouble"
    attempt = registry.current_attempt(reg)["attempt"]
    suspect = reg.get("suspect")
    if not suspect or suspect.get("kind") != verdict.kind or suspect.get("attempt") != attempt:
        suspect = reg["suspect"] = {"kind": verdict.kind, "attempt": attempt, "first_at": now, "observations": 0}
    suspect.update(last_at=now, observations=suspect["observations"] + 1, detail=_first_line(verdict.detail))
    confirm_s = cfg.fault_tolerance.confirm_s
    looks = CONFIRM_OBSERVATIONS if confirm_s else 1  # confirm_s 0: no confirmation asked for, the first look acts
    held = Suspicion(suspect["first_at"], suspect["observations"]).held(now, confirm_s, looks)
    return "trouble" if held else "suspect"


def cleared(reg: dict[str, Any], now: float, why: str) -> dict[str, Any] | None:
    """End an open suspicion that did not hold: it goes into the incident log as observed, not acted on."""
    suspect = reg.pop("suspect", None)
    if not suspect:
        return None
    entry = {"kind": suspect["kind"], "detected_by": "watchdog", "detected_at": suspect["first_at"],
             "attempt": suspect["attempt"], "action": "observed", "observations": suspect["observations"],
             "cleared_at": now, "held_s": round(now - suspect["first_at"], 3),
             "detail": f"{suspect.get('detail', '')} -- {why}"}  # fmt: skip
    reg.setdefault("incidents", []).append(entry)
    return entry


def backoff_s(cfg: Config, restarts_done: int) -> float:
    """Wait before restart number ``restarts_done + 1``: base, 2x base, 4x base ... capped."""
    ft = cfg.fault_tolerance
    return min(ft.restart_backoff_s * 2**restarts_done, ft.restart_backoff_max_s)


def preempted(incident: dict[str, Any]) -> bool:
    """A preemption (SIGTERM, a drained node) is the platform's doing, never a failure of the run."""
    error = incident.get("error") or {}
    return bool(error.get("preempted")) or error.get("type") == "Preempted" or incident.get("kind") == "preempted"


def budget_used(reg: dict[str, Any], cfg: Config, current: dict[str, Any]) -> int:
    """Restarts counted against ``max_restarts``: those since the last attempt that trained at least
    ``progress_resets_budget_steps`` new steps before it failed, preemptions left out."""
    window = cfg.fault_tolerance.progress_resets_budget_steps
    if window and current.get("progress_steps", 0) >= window:
        return 0
    used = 0
    for inc in reg.get("incidents", []):
        if inc is current or inc.get("action") != "restarted":
            continue
        if window and inc.get("progress_steps", 0) >= window:
            used = 0
        used += not preempted(inc)
    return used


def give_up_reason(reg: dict[str, Any], cfg: Config, incident: dict[str, Any]) -> str | None:
    """Why restarting again would be pointless or not allowed (naming the rule); None when a restart is in order."""
    error = incident.get("error") or {}
    if preempted(incident):
        return None
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
    used, budget = budget_used(reg, cfg, incident), cfg.fault_tolerance.max_restarts
    if used >= budget:
        window = cfg.fault_tolerance.progress_resets_budget_steps
        since = f" since the last attempt that trained {window}+ steps" if window else ""
        return (
            f"restart budget exhausted: {used} of fault_tolerance.max_restarts={budget} restarts used{since} "
            "(preemptions not counted; fault_tolerance.progress_resets_budget_steps resets the count)"
        )
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
    cfg = from_json(json.dumps(reg["config"]))
    incident = registry.open_incident(reg)
    if incident is None:
        verdict = inspect(reg, cfg, now)
        seen = confirm(reg, verdict, cfg, now)
        if seen == "healthy":
            return _healthy(cfg, reg, verdict, now)
        if seen == "suspect":
            registry.save(storage, run, reg)
            s = reg["suspect"]
            return Outcome(run, "observing", f"{verdict.kind} seen {s['observations']}x over "
                           f"{now - s['first_at']:.0f}s, not acted on yet: {_first_line(verdict.detail)}")  # fmt: skip
        incident = _open(cfg, reg, verdict, now)
        registry.save(storage, run, reg)
        run_logger().warning("run %s: %s detected: %s", run, incident["kind"], verdict.detail)
    reason = give_up_reason(reg, cfg, incident)
    if reason is not None:
        return _give_up(cfg, reg, incident, reason)
    due = incident["detected_at"] + backoff_s(cfg, budget_used(reg, cfg, incident))
    if now < due:
        incident.update(action="waiting", next_restart_at=due)
        registry.save(storage, run, reg)
        return Outcome(run, "waiting", f"restart in {due - now:.0f}s (backoff)", incident)
    return _restart(cfg, reg, incident, lease)


def _healthy(cfg: Config, reg: dict[str, Any], verdict: Verdict, now: float) -> Outcome:
    """Nothing to do but keep the record current (a healthy run costs no write per pass)."""
    changed = cleared(reg, now, f"healthy again ({verdict.status or verdict.kind})") is not None
    if verdict.kind == "succeeded":
        return _finish(cfg, reg, verdict)
    changed |= _note_progress(reg, verdict.heartbeat)
    findings: list[str] = []
    if verdict.status == "RUNNING":
        changed |= registry.set_running(reg, registry.current_attempt(reg)["attempt"])
        noted, findings = look_at_cluster(cfg, reg, now)
        changed |= noted
    if changed:
        registry.save(cfg.storage, cfg.name, reg)
    step = verdict.heartbeat["step"] if verdict.heartbeat else "-"
    detail = f"{verdict.status}, step {step}, phase {verdict.phase or '-'}"
    return Outcome(cfg.name, "ok", detail + "".join(f"; {f}" for f in findings))


def look_at_cluster(cfg: Config, reg: dict[str, Any], now: float, read=None) -> tuple[bool, list[str]]:
    """The cluster's health while its job runs (its backend's ``health``, control/backends/health.py): each new
    finding becomes an incident of its kind with action ``noted`` (named, logged, never a restart: the job still
    runs, and Ray Train or the next failure decides), and one that no longer holds is marked cleared. Returns
    (registry changed, the findings' keys).

    Nodes expected: the most the current attempt's cluster had alive at any look. A summary that cannot be read
    concludes nothing (whether the cluster answers at all is the job check's business)."""
    h = read(reg["cluster"]["address"]) if read else backend_for(cfg).health(_recorded_handle(reg))
    if h.nodes is None:
        return False, []
    attempt = registry.current_attempt(reg)["attempt"]
    shape = reg.get("shape") or {}
    if shape.get("attempt") != attempt:
        shape = {"attempt": attempt, "nodes": 0}
    changed = shape != reg.get("shape") or len(h.alive) > shape["nodes"]
    shape["nodes"] = max(shape["nodes"], len(h.alive))
    reg["shape"] = shape
    findings = health.assess(h, cfg, shape["nodes"], health.disk_usage(cfg.storage))
    keys = [f.key() for f in findings]
    noted = {i["detail"]: i for i in reg.get("incidents", []) if i.get("action") == "noted" and "cleared_at" not in i}
    for f in findings:
        if f.key() not in noted:
            run_logger().warning("run %s: cluster health: %s", cfg.name, f.key())
            incident = {"kind": f.kind, "detected_by": "watchdog (cluster health)", "detected_at": now,
                        "attempt": attempt, "action": "noted", "detail": f.key()}  # fmt: skip
            if f.kind == "nodes-missing" and (repair := _replace_nodes(cfg)) is not None:
                incident["repair"] = repair
            reg.setdefault("incidents", []).append(incident)
            changed = True
    for key, inc in noted.items():
        if key not in keys:
            inc["cleared_at"] = now
            changed = True
    return changed, keys


def _replace_nodes(cfg: Config) -> str | None:
    """Ask the run's backend for its missing nodes back, if it repairs lost nodes (control/backends:
    ``replace_nodes``); what it did, for the incident, or None when it does not."""
    backend = backend_for(cfg)
    try:
        done = backend.replace_nodes(cfg.name)
    except ClusterError as e:
        run_logger().warning("run %s: could not ask for replacement nodes: %s", cfg.name, e)
        return f"{backend.name} up failed: {e}"[:300]
    if done is not None:
        run_logger().info("run %s: asked %s for replacement nodes: %s", cfg.name, backend.name, done)
    return done


def new_incident(
    cfg: Config, attempt: dict[str, Any], verdict: Verdict, now: float, detected_by: str = "watchdog"
) -> dict[str, Any]:
    """An incident record for trouble with ``attempt``: what, when, and how far the attempt had got."""
    beat = verdict.heartbeat
    started_step = beat.get("started_step", _resumed_step(attempt)) if beat else _resumed_step(attempt)
    failed_step = max(beat["step"] if beat else started_step, last_step(Layout(cfg.storage).metrics(cfg.name)))
    last_progress = beat["last_step_at"] if beat else attempt["started_at"]
    return {
        "kind": verdict.kind,
        "detected_by": detected_by,
        "detected_at": now,
        "attempt": attempt["attempt"],
        "failed_step": failed_step,
        "progress_steps": max(0, failed_step - started_step),  # what this attempt trained: resets the budget
        "phase": verdict.phase or None,
        "last_progress_at": last_progress,
        "silent_s": round(now - last_progress, 3),
        "detail": _first_line(verdict.detail),
        "error": verdict.error,
    }


def _open(cfg: Config, reg: dict[str, Any], verdict: Verdict, now: float) -> dict[str, Any]:
    """Record the incident and end the current attempt; the run is ``recovering`` from here."""
    attempt = registry.current_attempt(reg)
    incident = new_incident(cfg, attempt, verdict, now)
    suspect = reg.pop("suspect", None)
    if suspect and suspect["kind"] == verdict.kind:  # confirmed: detected when first seen, acted on now
        incident.update(detected_at=suspect["first_at"], confirmed_at=now, observations=suspect["observations"])
    attempt.update(status={"job-failed": "FAILED", "stalled": "STALLED"}.get(verdict.kind, "LOST"),
                   ended_at=now, message=incident["detail"])  # fmt: skip
    reg.setdefault("incidents", []).append(incident)
    reg["state"] = "recovering"
    return incident


def failed_job_incident(cfg: Config, attempt: int, address: str, failure: Exception) -> dict[str, Any]:
    """For the finetune flow, whose watch saw its job fail (or its cluster vanish): the incident the watchdog
    would have written."""
    from control.jobs import ClusterLost

    reg = registry.load(cfg.storage, cfg.name)
    entry = reg["attempts"][attempt - 1]
    lost = isinstance(failure, ClusterLost)
    error = None if lost else job_failure(address, entry["submission_id"])
    beat = current_heartbeat(cfg.storage, cfg.name, attempt)
    verdict = Verdict("cluster-unreachable" if lost else "job-failed", str(failure), error, beat)
    return new_incident(cfg, entry, verdict, time.time(), "finetune-flow")


def _resumed_step(attempt: dict[str, Any]) -> int:
    return ckpt.checkpoint_step(attempt["resume_from"]) if attempt.get("resume_from") else 0


def _restart(cfg: Config, reg: dict[str, Any], incident: dict[str, Any], lease: leases.Lease) -> Outcome:
    """Stop what is left, re-provision if needed, resume from the newest valid checkpoint under a new submission."""
    log = run_logger()
    run, storage = cfg.name, cfg.storage
    old = registry.current_attempt(reg)
    again = inspect(reg, cfg, time.time())  # decided earlier (maybe a backoff ago): look once more before acting
    if not again.trouble:
        return _stand_down(cfg, reg, incident, again)
    _stop_leftovers(cfg, reg, old["submission_id"])  # verified, or this raises and nothing is submitted
    lease.renew()
    handle = provision(cfg)  # the finetune flow's task: starts a local head again if it is gone
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
        handle.to_dict() | {"started_here": owned},
        reg["dataset_id"],
        resume_from=resume_from,
        started_by="watchdog",
        extra={k: reg.get(k) for k in ("manifest_url", "model_path", "score_manifest_url")},
        lease=lease,
    )
    spec = write_job_spec(
        cfg, attempt, reg["manifest_url"], reg["model_path"], resume_from, reg.get("score_manifest_url")
    )
    sid = submit(handle, registry.submission_id(run, attempt), "ray_jobs.job", spec)
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


def _stand_down(cfg: Config, reg: dict[str, Any], incident: dict[str, Any], verdict: Verdict) -> Outcome:
    """The trouble is gone when looked at again right before the restart: the attempt carries on, the incident
    stays in the log as observed."""
    now = time.time()
    incident.update(action="observed", cleared_at=now, detail=f"{incident.get('detail', '')} -- healthy again "
                    f"({verdict.status or verdict.kind}) when re-checked before the restart")  # fmt: skip
    attempt = registry.current_attempt(reg)
    attempt.pop("ended_at", None)
    attempt.update(status="RUNNING" if verdict.status == "RUNNING" else "SUBMITTED", message="")
    if incident.get("detected_by") != "watchdog":  # the flow that handed it over has ended: the watchdog adopts it
        attempt.update(adopted_by="watchdog", adopted_at=now)
    reg["state"] = "running" if attempt["status"] == "RUNNING" else "submitted"
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().warning("run %s: %s no longer holds; not restarting", cfg.name, incident["kind"])
    if verdict.kind == "succeeded":
        return _finish(cfg, reg, verdict)
    return Outcome(cfg.name, "ok", f"{incident['kind']} cleared on re-check: {verdict.status}", incident)


def _stop_leftovers(cfg: Config, reg: dict[str, Any], sid: str) -> None:
    """Make sure the failed attempt's job no longer runs before another is submitted: stop it and wait until Ray
    says it ended. When the cluster cannot tell (unreachable), its backend takes down what ends the job for certain
    (``stop_unreachable``: a local head of ours by its processes, a cluster unbroken brought up through its
    ``down``); anyone else's cluster: StopUnverified, and no new attempt -- two jobs must never train into the same
    checkpoints."""
    address = reg["cluster"]["address"]
    try:
        if stop_and_wait(address, sid, STOP_WAIT_S):
            run_logger().info("stopped what was left of Ray job %s", sid)
    except StopUnverified:  # the backend's to end for certain, or StopUnverified again
        done = backend_for(cfg).stop_unreachable(_recorded_handle(reg), cfg.name)
        run_logger().warning("the Ray cluster at %s does not answer: %s", address, done)


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
    if attempt.get("started_by") == "watchdog" or attempt.get("adopted_by") == "watchdog":
        _release_cluster(cfg, reg)  # no flow is left to stop it
        series.finish_run(cfg.storage, cfg.name)  # nor to score it against the series' champion
    return Outcome(cfg.name, "succeeded", f"final model: {reg.get('final_model', '-')}")


def _release_cluster(cfg: Config, reg: dict[str, Any]) -> None:
    """The run is over and no flow is left to release its cluster: its backend's ``down`` (a local head stops when
    no other run uses it; a cluster unbroken brought up is removed unless kept; someone else's is left alone)."""
    if cfg.cluster.keep_running:
        return
    with contextlib.suppress(ClusterError):  # stop_cluster leaves alone a cluster the run did not bring up
        release(cfg, _recorded_handle(reg), run=cfg.name)


def _recorded_handle(reg: dict[str, Any]) -> ClusterHandle:
    """The run's cluster as its registry recorded it."""
    return handle_from_record(reg["cluster"])


def _give_up(cfg: Config, reg: dict[str, Any], incident: dict[str, Any], reason: str) -> Outcome:
    with contextlib.suppress(ClusterError):  # giving up must not hinge on reaching the cluster
        _stop_leftovers(cfg, reg, registry.current_attempt(reg)["submission_id"])
    incident.update(action="gave-up", reason=reason, gave_up_at=time.time())
    reg.update(state="failed", reason=reason)
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().error("run %s: giving up: %s", cfg.name, reason)
    _release_cluster(cfg, reg)
    return Outcome(cfg.name, "gave-up", reason, incident)


def janitor(storage: str) -> list[str]:
    """Remove what unbroken made for runs under ``storage`` that are over (finished, failed, or their record gone)
    and did not ask to keep it -- what a flow or watchdog killed before its ``down`` left running: one pass of each
    backend that leaves such things behind (control/backends/janitor.py). Returns what was removed."""
    return [what for backend in janitor_backends() for what in sweep(backend, storage)]
