"""The watchdog's judgement: ``decide(record, observations, config) -> Decision`` -- the run record as it should
be after this pass, the side effects to carry out, and what to report. Pure: no I/O, no clock (``now`` is observed),
the record it is given is left as it was. Unit-tested with tables of cases (tests/unit/test_decide.py).

Like a Kubernetes controller's reconcile: trouble that is a fact (the Jobs API says the job failed, its heartbeat
says it is stuck) is acted on at once; an ambiguous sign (no answer from the cluster, a job it does not know, a
heartbeat gone quiet) only once it held (control/confirm.py) and the heartbeat did not move meanwhile; channels that
disagree (the API silent, the heartbeat fresh) are observed and never acted on; a restart waits out a backoff and is
re-checked right before it happens (act).

What a decision is made of is control/watchdog/decision.py's (re-exported here: act.py takes it from this module);
an ambiguous sign's confirming is suspects.py's, what a healthy run's look notes is notes.py's, the restart policy
policy.py's."""

from __future__ import annotations

from typing import Any

from control import lifecycle
from control.rayapi import first_line
from control.records.run import Incident, RunRecord
from control.watchdog.decision import (
    CloseRun,
    Decision,
    GiveUp,
    Log,
    Outcome,
    Reattach,
    ReleaseCluster,
    Restart,
    Resubmit,
    Save,
)
from control.watchdog.decision import ReplaceNodes as ReplaceNodes
from control.watchdog.notes import note_api, note_heals, note_health, note_progress
from control.watchdog.observe import Observations
from control.watchdog.policy import backoff_s, budget_used, give_up_reason
from control.watchdog.suspects import cleared, confirm
from control.watchdog.verdict import Verdict, classify, heartbeat_age
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config

CLOSE_GRACE_S = 120.0  # a succeeded run's flow closes it within this; after it, the watchdog does


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
    verdict = verdict_of(reg, obs, cfg)
    seen = confirm(reg, verdict, cfg, now)
    if seen == "healthy":
        return healthy(reg, verdict, obs, cfg)
    if seen == "suspect":
        s = reg.suspect
        assert s is not None, "confirm() keeps in reg.suspect the suspicion it calls suspect"
        detail = (
            f"{verdict.kind} seen {s.observations}x over {now - s.first_at:.0f}s, not acted on yet: "
            f"{first_line(verdict.detail)}"
        )
        return Decision(reg, [Save()], Outcome(reg.name, "observing", detail))
    incident = open_incident(reg, verdict, cfg, obs)
    warn = Log("warning", f"run {reg.name}: {incident.kind} detected: {verdict.detail}")
    return handle_incident(reg, incident, cfg, now, [warn])


def verdict_of(reg: RunRecord, obs: Observations, cfg: Config) -> Verdict:
    """What one look at the current attempt means (``obs.job``: observe() asked the Jobs API)."""
    assert obs.job is not None, "observe() asks the Jobs API whenever no incident is open"
    address = reg.recorded_cluster.address
    return classify(
        obs.job,
        reg.current,
        obs.heartbeat,
        cfg,
        obs.now,
        address,
        obs.error,
        obs.beat_age_s,
        obs.job_gone,
        obs.driver_dead,
    )


def handle_incident(reg: RunRecord, incident: Incident, cfg: Config, now: float, actions: list) -> Decision:
    """An open incident: give up (a rule says a restart is pointless), wait out the backoff, or restart."""
    reason = give_up_reason(reg, cfg, incident)
    if reason is not None:
        incident.set(action="gave-up", reason=reason, gave_up_at=now)
        lifecycle.move(reg, "failed")
        reg.reason = reason
        steps = [GiveUp(), Log("error", f"run {reg.name}: giving up: {reason}")]
        return Decision(reg, actions + steps + _release(cfg), Outcome(reg.name, "gave-up", reason, incident))
    due = (incident.last_try_at or incident.detected_at) + backoff_s(cfg, budget_used(reg, cfg, incident))
    if now < due:
        incident.set(action="waiting", next_restart_at=due)
        return Decision(
            reg, [Save(), *actions], Outcome(reg.name, "waiting", f"restart in {due - now:.0f}s (backoff)", incident)
        )
    return Decision(reg, [Save(), *actions, Restart()], Outcome(reg.name, "restarting", incident.kind, incident))


def recheck(reg: RunRecord, again: Observations, cfg: Config) -> Decision:
    """A restart decided, looked at again right before it happens (under the lease): still trouble -> Resubmit;
    gone -> the incident stood down, the attempt carries on (or, found succeeded, is finished)."""
    reg = reg.deep_copy()
    incident = reg.open_incident()
    assert incident is not None and again.job is not None, "a restart is decided for an open incident; look() asks"
    verdict = verdict_of(reg, again, cfg)
    if verdict.trouble:
        return Decision(reg, [Resubmit()], Outcome(reg.name, "restarting", incident.kind, incident))
    stand_down(reg, incident, verdict, again.now)
    steps = [Save(), Log("warning", f"run {reg.name}: {incident.kind} no longer holds; not restarting")]
    if verdict.kind == "succeeded":
        done = finish(reg, verdict, again, cfg)
        return Decision(done.record, steps + done.actions, done.outcome)
    why = f"{incident.kind} cleared on re-check: {verdict.status or verdict.kind}"
    if verdict.kind == "driver-lost":  # its run host trains on: a driver re-attaches, nothing is restarted
        return Decision(reg, [*steps, Reattach()], Outcome(reg.name, "reattached", verdict.detail, incident))
    return Decision(reg, steps, Outcome(reg.name, "ok", why, incident))


# -- healthy ----------------------------------------------------------------------------------------------------
def healthy(reg: RunRecord, verdict: Verdict, obs: Observations, cfg: Config) -> Decision:
    """Nothing to do but keep the record current (a healthy run costs no write per pass). The Jobs API silent while
    the heartbeat is fresh is noted as an incident of its own (observed: logged, counted, shown by status)."""
    why = "the job's heartbeat is fresh" if verdict.kind == "api-unreachable" else "healthy again"
    changed = cleared(reg, obs.now, f"{why} ({verdict.status or verdict.kind})") is not None
    if verdict.kind == "succeeded":
        return finish(reg, verdict, obs, cfg)
    changed |= note_progress(reg, verdict.heartbeat)
    if verdict.kind == "driver-lost":  # the re-attach records the new driver (and what else changed)
        return Decision(reg, [Reattach()], Outcome(reg.name, "reattached", verdict.detail))
    noted, actions = note_api(reg, verdict, obs.now)
    replaced, more = note_heals(reg, verdict.heartbeat)
    changed, actions = changed | noted | replaced, actions + more
    findings = []
    if verdict.status == "RUNNING":
        changed |= lifecycle.mark_running(reg, reg.current.attempt)
        noted, findings, more = note_health(reg, cfg, obs)
        changed, actions = changed | noted, actions + more
    step = verdict.heartbeat.step if verdict.heartbeat else "-"
    status = verdict.status or ("Jobs API silent" if verdict.kind == "api-unreachable" else "")
    detail = f"{status}, step {step}, phase {verdict.phase or '-'}" + "".join(f"; {f}" for f in findings)
    return Decision(reg, actions + ([Save()] if changed else []), Outcome(reg.name, "ok", detail))


def finish(reg: RunRecord, verdict: Verdict, obs: Observations, cfg: Config) -> Decision:
    """The job succeeded: record it, and close the run (score it in its series, release its cluster) -- at once for
    an attempt the watchdog started or adopted (no flow is left to), otherwise once its flow has not for
    CLOSE_GRACE_S (:func:`close`)."""
    note_progress(reg, verdict.heartbeat)
    attempt = reg.current
    attempt.set(status="SUCCEEDED", ended_at=attempt.ended_at or obs.now)
    lifecycle.move(reg, "succeeded")
    reg.closing_since = reg.closing_since or obs.now
    if obs.final_model:
        reg.final_model = obs.final_model
    closing = close(reg, obs.now, cfg)  # its Save comes after the closing's side effects: a closing that raises
    # leaves the record as it was, and the next pass closes again
    return Decision(
        reg, closing.actions or [Save()], Outcome(reg.name, "succeeded", f"final model: {reg.final_model or '-'}")
    )


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
    return Decision(reg, [CloseRun(), Save()], Outcome(reg.name, "closed", f"final model: {reg.final_model or '-'}"))


def _release(cfg: Config) -> list[Any]:
    return [] if cfg.cluster.keep_running else [ReleaseCluster()]


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
    incident = Incident(
        kind=verdict.kind,
        detected_by=by,
        detected_at=obs.now,
        attempt=attempt.attempt,
        failed_step=failed_step,
        progress_steps=max(0, failed_step - started_step),
        phase=verdict.phase or None,
        last_progress_at=last_progress,
        silent_s=round(silent, 3),
        detail=first_line(verdict.detail),
        error=verdict.error,
    )
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
    lifecycle.move(reg, "recovering")
    return incident


def stand_down(reg: RunRecord, incident: Incident, verdict: Verdict, now: float) -> None:
    """The trouble is gone when looked at again right before the restart: the attempt carries on, the incident
    stays in the log as observed. A flow that handed the run over has ended: the watchdog adopts the attempt."""
    incident.set(
        action="observed",
        cleared_at=now,
        detail=f"{incident.detail} -- healthy again "
        f"({verdict.status or verdict.kind}) when re-checked before the restart",
    )
    attempt = reg.current
    attempt.unset("ended_at")
    attempt.set(status="RUNNING" if verdict.status == "RUNNING" else "SUBMITTED", message="")
    if incident.detected_by != "watchdog":
        attempt.set(adopted_by="watchdog", adopted_at=now)
    lifecycle.move(reg, "running" if attempt.status == "RUNNING" else "submitted")


def resumed_step(resume_from: str | None) -> int:
    return ckpt.checkpoint_step(resume_from) if resume_from else 0
