"""An ambiguous sign held as the run's suspect (``reg.suspect``) until it is confirmed -- trouble to act on -- or
cleared -- observed, not acted on (control/confirm.py says when a suspicion held). Pure: changes only the record it
is given (decide hands it a copy)."""

from __future__ import annotations

from control.confirm import Suspicion
from control.rayapi import first_line
from control.records.run import Incident, RunRecord, Suspect
from control.watchdog.verdict import Verdict
from ray_jobs.config import Config

CONFIRM_OBSERVATIONS = 2  # looks an ambiguous sign must be seen in (besides holding for confirm_s)


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
    entry = Incident(
        kind=s.kind,
        detected_by="watchdog",
        detected_at=s.first_at,
        attempt=s.attempt,
        action="observed",
        observations=s.observations,
        cleared_at=now,
        held_s=round(now - s.first_at, 3),
        detail=f"{s.detail} -- {why}",
    )
    reg.incidents.append(entry)
    return entry
