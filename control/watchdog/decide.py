"""The watchdog's judgement: ``decide(record, observations, config) -> Decision`` -- the run record as it should
be after this pass, the side effects to carry out, and what to report. Pure: no I/O, no clock (``now`` is observed),
the record it is given is left as it was. Unit-tested with tables of cases (tests/unit/test_decide.py).

Like a Kubernetes controller's reconcile: trouble that is a fact (the Jobs API says the job failed, its heartbeat
says it is stuck) is acted on at once; an ambiguous sign (no answer from the cluster, a job it does not know, a
heartbeat gone quiet) only once it held (control/confirm.py) and the heartbeat did not move meanwhile; channels that
disagree (the API silent, the heartbeat fresh) are observed and never acted on; a restart waits out a backoff and is
re-checked right before it happens (act)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from control.backends.health import assess
from control.confirm import Suspicion
from control.rayapi import first_line
from control.records.run import Incident, RunRecord, Shape, Suspect
from control.watchdog.observe import Observations
from control.watchdog.policy import backoff_s, budget_used, give_up_reason
from control.watchdog.verdict import Verdict, classify, heartbeat_age
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat

CONFIRM_OBSERVATIONS = 2  # looks an ambiguous sign must be seen in (besides holding for confirm_s)
CLOSE_GRACE_S = 120.0  # a succeeded run's flow closes it within this; after it, the watchdog does


# -- what to do -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Save:
    """Write the decided record (under the run's lease)."""


@dataclass(frozen=True)
class Restart:
    """Restart -- decided maybe a backoff ago, so the pass looks once more right before it and decides on that look
    (:func:`recheck`): a :class:`Resubmit`, or the incident stood down."""


@dataclass(frozen=True)
class Resubmit:
    """Stop what is left of the job, re-provision, resume from the newest valid checkpoint under a new submission
    (control/watchdog/restart.py)."""


@dataclass(frozen=True)
class GiveUp:
    """Stop what is left of the job (best effort), record the run failed, release its cluster."""


@dataclass(frozen=True)
class ReleaseCluster:
    """The run is over and no flow is left to release its cluster: its backend's ``down``."""


@dataclass(frozen=True)
class CloseRun:
    """Close the succeeded run no flow is left to close: score it in its series, release its cluster unless kept
    (control/attempt.close_run, the flow's closing too)."""


@dataclass(frozen=True)
class ReplaceNodes:
    """Ask the backend for the cluster's lost nodes back; the health incident ``detail`` records what it did."""

    detail: str


@dataclass(frozen=True)
class Log:
    level: str  # info | warning | error
    message: str


@dataclass
class Outcome:
    run: str
    # ok | observing | succeeded | closed | restarted | restart-failed | waiting | gave-up | skipped | inactive |
    # elsewhere (a local head on another host) | unreadable (a record this release cannot read) | storage-unreachable
    action: str
    detail: str = ""
    incident: Incident | None = None


@dataclass
class Decision:
    record: RunRecord  # the record as it should be (a copy: the observed one is left as it was)
    actions: list[Any]
    outcome: Outcome


# -- the decision -----------------------------------------------------------------------------------------------
def decide(reg: RunRecord, obs: Observations, cfg: Config) -> Decision:
    """The whole judgement of one pass over an active run (or a succeeded one still to be closed)."""
    reg, now = reg.deep_copy(), obs.now
    if reg.state == "succeeded":
        return close(reg, now, cfg)
    incident = reg.open_incident()
    if incident is not None:
        return handle_incident(reg, incident, cfg, now, [])
    assert obs.job is not None, "observe() asks the Jobs API whenever no incident is open"
    verdict = classify(obs.job, reg.current, obs.heartbeat, cfg, now, reg.recorded_cluster.address, obs.error,
                       obs.beat_age_s, obs.job_gone)  # fmt: skip
    seen = confirm(reg, verdict, cfg, now)
    if seen == "healthy":
        return healthy(reg, verdict, obs, cfg)
    if seen == "suspect":
        s = reg.suspect
        assert s is not None, "confirm() keeps in reg.suspect the suspicion it calls suspect"
        detail = (f"{verdict.kind} seen {s.observations}x over {now - s.first_at:.0f}s, not acted on yet: "
                  f"{first_line(verdict.detail)}")  # fmt: skip
        return Decision(reg, [Save()], Outcome(reg.name, "observing", detail))
    incident = open_incident(reg, verdict, cfg, obs)
    warn = Log("warning", f"run {reg.name}: {incident.kind} detected: {verdict.detail}")
    return handle_incident(reg, incident, cfg, now, [warn])


def handle_incident(reg: RunRecord, incident: Incident, cfg: Config, now: float, actions: list) -> Decision:
    """An open incident: give up (a rule says a restart is pointless), wait out the backoff, or restart."""
    reason = give_up_reason(reg, cfg, incident)
    if reason is not None:
        incident.set(action="gave-up", reason=reason, gave_up_at=now)
        reg.set(state="failed", reason=reason)
        steps = [GiveUp(), Log("error", f"run {reg.name}: giving up: {reason}")]
        return Decision(reg, actions + steps + _release(cfg), Outcome(reg.name, "gave-up", reason, incident))
    due = (incident.last_try_at or incident.detected_at) + backoff_s(cfg, budget_used(reg, cfg, incident))
    if now < due:
        incident.set(action="waiting", next_restart_at=due)
        return Decision(reg, [Save(), *actions], Outcome(reg.name, "waiting", f"restart in {due - now:.0f}s (backoff)",
                                                         incident))  # fmt: skip
    return Decision(reg, [Save(), *actions, Restart()], Outcome(reg.name, "restarting", incident.kind, incident))


def recheck(reg: RunRecord, again: Observations, cfg: Config) -> Decision:
    """A restart decided, looked at again right before it happens (under the lease): still trouble -> Resubmit;
    gone -> the incident stood down, the attempt carries on (or, found succeeded, is finished)."""
    reg = reg.deep_copy()
    incident = reg.open_incident()
    assert incident is not None and again.job is not None, "a restart is decided for an open incident; look() asks"
    verdict = classify(again.job, reg.current, again.heartbeat, cfg, again.now, reg.recorded_cluster.address,
                       again.error, again.beat_age_s, again.job_gone)  # fmt: skip
    if verdict.trouble:
        return Decision(reg, [Resubmit()], Outcome(reg.name, "restarting", incident.kind, incident))
    stand_down(reg, incident, verdict, again.now)
    steps = [Save(), Log("warning", f"run {reg.name}: {incident.kind} no longer holds; not restarting")]
    if verdict.kind == "succeeded":
        done = finish(reg, verdict, again, cfg)
        return Decision(done.record, steps + done.actions, done.outcome)
    why = f"{incident.kind} cleared on re-check: {verdict.status or verdict.kind}"
    return Decision(reg, steps, Outcome(reg.name, "ok", why, incident))


def confirm(reg: RunRecord, verdict: Verdict, cfg: Config, now: float) -> str:
    """What this look means given the earlier ones: ``healthy``, ``suspect`` (an ambiguous sign, not confirmed yet)
    or ``trouble`` (act). Keeps the open suspicion in ``reg.suspect``: confirmed once it held for ``confirm_s`` over
    several looks with the job's heartbeat unmoved all along (a heartbeat that moved says the job lives: the
    suspicion starts over)."""
    if not verdict.trouble:
        return "healthy"
    if verdict.definitive:
        return "trouble"
    attempt, beat_time = reg.current.attempt, (verdict.heartbeat.time if verdict.heartbeat else None)
    s = reg.suspect
    if s is None or s.kind != verdict.kind or s.attempt != attempt or s.beat_time != beat_time:
        s = reg.suspect = Suspect(kind=verdict.kind, attempt=attempt, first_at=now, observations=0)
        if beat_time is not None:
            s.beat_time = beat_time
    s.set(last_at=now, observations=s.observations + 1, detail=first_line(verdict.detail))
    confirm_s = cfg.fault_tolerance.confirm_s
    looks = CONFIRM_OBSERVATIONS if confirm_s else 1  # confirm_s 0: no confirmation asked for, the first look acts
    return "trouble" if Suspicion(s.first_at, s.observations).held(now, confirm_s, looks) else "suspect"


def cleared(reg: RunRecord, now: float, why: str) -> Incident | None:
    """End an open suspicion that did not hold: it goes into the incident log as observed, not acted on."""
    s = reg.suspect
    if s is None:
        return None
    reg.unset("suspect")
    entry = Incident(kind=s.kind, detected_by="watchdog", detected_at=s.first_at, attempt=s.attempt, action="observed",
                     observations=s.observations, cleared_at=now, held_s=round(now - s.first_at, 3),
                     detail=f"{s.detail} -- {why}")  # fmt: skip
    reg.incidents.append(entry)
    return entry


# -- healthy ----------------------------------------------------------------------------------------------------
def healthy(reg: RunRecord, verdict: Verdict, obs: Observations, cfg: Config) -> Decision:
    """Nothing to do but keep the record current (a healthy run costs no write per pass). The Jobs API silent while
    the heartbeat is fresh is noted as an incident of its own (observed: logged, counted, shown by status)."""
    why = "the job's heartbeat is fresh" if verdict.kind == "api-unreachable" else "healthy again"
    changed = cleared(reg, obs.now, f"{why} ({verdict.status or verdict.kind})") is not None
    if verdict.kind == "succeeded":
        return finish(reg, verdict, obs, cfg)
    changed |= note_progress(reg, verdict.heartbeat)
    noted, actions = note_api(reg, verdict, obs.now)
    replaced, more = note_heals(reg, verdict.heartbeat)
    changed, actions = changed | noted | replaced, actions + more
    findings = []
    if verdict.status == "RUNNING":
        changed |= reg.mark_running(reg.current.attempt)
        noted, findings, more = note_health(reg, cfg, obs)
        changed, actions = changed | noted, actions + more
    step = verdict.heartbeat.step if verdict.heartbeat else "-"
    status = verdict.status or ("Jobs API silent" if verdict.kind == "api-unreachable" else "")
    detail = f"{status}, step {step}, phase {verdict.phase or '-'}" + "".join(f"; {f}" for f in findings)
    return Decision(reg, actions + ([Save()] if changed else []), Outcome(reg.name, "ok", detail))


def note_api(reg: RunRecord, verdict: Verdict, now: float) -> tuple[bool, list[Any]]:
    """Keep the ``api-unreachable`` incident of the current attempt up to date: opened (and logged) when the API
    first fails while the heartbeat is fresh, its looks counted while it lasts, cleared once the API answers again.
    Returns (record changed, actions)."""
    attempt = reg.current.attempt
    ongoing = next((i for i in reg.incidents if i.kind == "api-unreachable" and i.cleared_at is None
                    and i.attempt == attempt), None)  # fmt: skip
    if verdict.kind != "api-unreachable":
        if ongoing is None:
            return False, []
        ongoing.set(cleared_at=now, held_s=round(now - ongoing.detected_at, 3))
        return True, [Log("info", f"run {reg.name}: the Jobs API answers again after {now - ongoing.detected_at:.0f}s")]
    if ongoing is not None:
        ongoing.set(observations=(ongoing.observations or 0) + 1, last_seen_at=now)
        return True, []
    reg.incidents.append(Incident(kind="api-unreachable", detected_by="watchdog", detected_at=now, attempt=attempt,
                                  action="observed", observations=1, last_seen_at=now,
                                  detail=first_line(verdict.detail)))  # fmt: skip
    message = f"run {reg.name}: {verdict.detail} -- observed, nothing stopped or restarted while it trains"
    return True, [Log("warning", message)]


def note_heals(reg: RunRecord, beat: Beat | None) -> tuple[bool, list[Any]]:
    """Live recovery replaced a lost replica inside the job (its heartbeat counts this attempt's heals): one
    ``replica-replaced`` incident each, observed -- training never stopped, nothing is for the watchdog to do."""
    attempt = reg.current.attempt
    if not beat or beat.attempt != attempt or not beat.heals:
        return False, []
    seen = sum(1 for i in reg.incidents if i.kind == "replica-replaced" and i.attempt == attempt)
    heal = beat.last_heal  # (every writer sets it with heals; a heartbeat without it still counts, unnamed)
    rank, step, heal_s, lost, at = (heal.rank, heal.step, heal.heal_s, heal.lost_steps, heal.at) if heal else \
        (None, None, None, 0, beat.time)  # fmt: skip
    detail = (
        f"replica {rank} replaced at step {step}: healed from a live peer in {heal_s}s, {lost} steps lost, "
        "training never stopped"
    )
    for _ in range(beat.heals - seen):  # a pass sees the last heal; earlier ones since the last pass, counted
        reg.incidents.append(Incident(kind="replica-replaced", detected_by="live recovery (in job)", detected_at=at,
                                      attempt=attempt, action="observed", failed_step=step, held_s=heal_s,
                                      detail=detail))  # fmt: skip
    if beat.heals <= seen:
        return False, []
    return True, [Log("info", f"run {reg.name}: {detail}")]


def finish(reg: RunRecord, verdict: Verdict, obs: Observations, cfg: Config) -> Decision:
    """The job succeeded: record it, and close the run (score it in its series, release its cluster) -- at once for
    an attempt the watchdog started or adopted (no flow is left to), otherwise once its flow has not for
    CLOSE_GRACE_S (:func:`close`)."""
    note_progress(reg, verdict.heartbeat)
    attempt = reg.current
    attempt.set(status="SUCCEEDED", ended_at=attempt.ended_at or obs.now)
    reg.state = "succeeded"
    reg.closing_since = reg.closing_since or obs.now
    if obs.final_model:
        reg.final_model = obs.final_model
    closing = close(reg, obs.now, cfg)  # its Save comes after the closing's side effects: a closing that raises
    # leaves the record as it was, and the next pass closes again
    return Decision(reg, closing.actions or [Save()],
                    Outcome(reg.name, "succeeded", f"final model: {reg.final_model or '-'}"))  # fmt: skip


def close(reg: RunRecord, now: float, cfg: Config) -> Decision:
    """A succeeded run still to be closed: the watchdog closes it -- score, promotion gate, cluster release, whoever
    started the attempt -- when no flow is left to (the watchdog started or adopted it), or when its flow has not
    for CLOSE_GRACE_S (its closing raised, or it was killed meanwhile). Closing twice is harmless: the gate keeps
    its first verdict, a release of what is gone does nothing."""
    attempt = reg.current
    waited = now - (reg.closing_since or now)
    if "watchdog" not in (attempt.started_by, attempt.adopted_by) and waited < CLOSE_GRACE_S:
        return Decision(reg, [], Outcome(reg.name, "ok", f"succeeded; closing left to its flow ({waited:.0f}s)"))
    reg.unset("closing_since")
    return Decision(reg, [CloseRun(), Save()],
                    Outcome(reg.name, "closed", f"final model: {reg.final_model or '-'}"))  # fmt: skip


def _release(cfg: Config) -> list[Any]:
    return [] if cfg.cluster.keep_running else [ReleaseCluster()]


def note_progress(reg: RunRecord, beat: Beat | None) -> bool:
    """Complete the last restart's incident once its attempt has trained a step: the time to recover.
    True when the record changed."""
    if not beat or not beat.first_step_at:
        return False
    for inc in reversed(reg.incidents):
        if inc.action == "restarted" and inc.new_attempt == beat.attempt:
            if inc.first_new_step_at is not None:
                return False
            first, since = beat.first_step_at, inc.last_progress_at
            inc.set(first_new_step_at=first, time_to_recover_s=round(first - inc.detected_at, 3))
            if since is not None:  # (an incident recorded by an older release may lack it: no downtime, no crash)
                inc.downtime_s = round(first - since, 3)
            return True
    return False


def note_health(reg: RunRecord, cfg: Config, obs: Observations) -> tuple[bool, list[str], list[Any]]:
    """The cluster's health while its job runs (control/backends/health.py): each new finding becomes an incident
    of its kind with action ``noted`` (named, logged, never a restart: the job still runs, and Ray Train or the next
    failure decides), a lost node is asked back of a backend that can; a finding that no longer holds is marked
    cleared. Nodes expected: the most the current attempt's cluster had alive at any look. A summary that cannot
    be read concludes nothing. Returns (record changed, the findings' keys, actions)."""
    h = obs.health
    if h is None or h.nodes is None:
        return False, [], []
    attempt = reg.current.attempt
    before = reg.shape.model_copy() if reg.shape else None
    if reg.shape is None or reg.shape.attempt != attempt:
        reg.shape = Shape(attempt=attempt, nodes=0)
    changed = reg.shape != before or len(h.alive) > reg.shape.nodes
    reg.shape.nodes = max(reg.shape.nodes, len(h.alive))
    findings = assess(h, cfg, reg.shape.nodes, obs.disk)
    keys = [f.key() for f in findings]
    noted = {i.detail: i for i in reg.incidents if i.action == "noted" and i.cleared_at is None}
    actions: list[Any] = []
    for f in (f for f in findings if f.key() not in noted):
        actions.append(Log("warning", f"run {reg.name}: cluster health: {f.key()}"))
        reg.incidents.append(Incident(kind=f.kind, detected_by="watchdog (cluster health)", detected_at=obs.now,
                                      attempt=attempt, action="noted", detail=f.key()))  # fmt: skip
        actions += [ReplaceNodes(f.key())] if f.kind == "nodes-missing" else []
        changed = True
    for key, inc in noted.items():
        if key not in keys:
            inc.cleared_at, changed = obs.now, True
    return changed, keys, actions


# -- trouble ----------------------------------------------------------------------------------------------------
def new_incident(cfg: Config, reg: RunRecord, verdict: Verdict, obs: Observations, by: str = "watchdog") -> Incident:
    """An incident record for trouble with the current attempt: what, when, and how far the attempt had got."""
    attempt, beat = reg.current, verdict.heartbeat
    said = beat is not None and "started_step" in beat.model_fields_set  # (a heartbeat that does not say: resumed)
    started_step = beat.started_step if beat and said else resumed_step(attempt.resume_from)
    failed_step = max(beat.step if beat else started_step, obs.metrics_step)
    last_progress = beat.last_step_at if beat else attempt.started_at
    age = heartbeat_age(beat, obs.now, obs.beat_age_s)
    silent = obs.now - last_progress if beat is None or age is None else beat.time - last_progress + age
    incident = Incident(kind=verdict.kind, detected_by=by, detected_at=obs.now, attempt=attempt.attempt,
                        failed_step=failed_step, progress_steps=max(0, failed_step - started_step),
                        phase=verdict.phase or None, last_progress_at=last_progress, silent_s=round(silent, 3),
                        detail=first_line(verdict.detail), error=verdict.error)  # fmt: skip
    if beat:
        incident.beat_time = beat.time
    return incident


def open_incident(reg: RunRecord, verdict: Verdict, cfg: Config, obs: Observations) -> Incident:
    """Record the incident and end the current attempt; the run is ``recovering`` from here."""
    incident = new_incident(cfg, reg, verdict, obs)
    s = reg.suspect
    reg.unset("suspect")
    if s is not None and s.kind == verdict.kind:  # confirmed: detected when first seen, acted on now
        incident.set(detected_at=s.first_at, confirmed_at=obs.now, observations=s.observations)
    status = {"job-failed": "FAILED", "stalled": "STALLED"}.get(verdict.kind, "LOST")
    reg.current.set(status=status, ended_at=obs.now, message=incident.detail)
    reg.incidents.append(incident)
    reg.state = "recovering"
    return incident


def stand_down(reg: RunRecord, incident: Incident, verdict: Verdict, now: float) -> None:
    """The trouble is gone when looked at again right before the restart: the attempt carries on, the incident
    stays in the log as observed. A flow that handed the run over has ended: the watchdog adopts the attempt."""
    incident.set(action="observed", cleared_at=now, detail=f"{incident.detail} -- healthy again "
                 f"({verdict.status or verdict.kind}) when re-checked before the restart")  # fmt: skip
    attempt = reg.current
    attempt.unset("ended_at")
    attempt.set(status="RUNNING" if verdict.status == "RUNNING" else "SUBMITTED", message="")
    if incident.detected_by != "watchdog":
        attempt.set(adopted_by="watchdog", adopted_at=now)
    reg.state = "running" if attempt.status == "RUNNING" else "submitted"


def resumed_step(resume_from: str | None) -> int:
    return ckpt.checkpoint_step(resume_from) if resume_from else 0
