"""What one look at a run's current attempt means: a :class:`Verdict` from the Jobs API's answer and the job's
heartbeat. Pure functions of what was observed (no I/O), shared by ``observe`` (to know what else to read) and
``decide``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from control.jobsapi import JobView
from control.records.run import Attempt
from ray_jobs.config import Config

# Kinds of trouble that are facts (the Jobs API said so; the job's own heartbeat says it is stuck): acted on at once.
DEFINITIVE = ("job-failed", "stalled")
# Kinds that may be a blip of the observer's path (a proxy's 502, a restarting dashboard, an auth hiccup): acted on
# only once they held for fault_tolerance.confirm_s (control/confirm.py).
AMBIGUOUS = ("cluster-unreachable", "job-lost")


@dataclass
class Verdict:
    """What the watchdog sees for the current attempt."""

    kind: str  # running | succeeded | job-failed | stalled | cluster-unreachable | job-lost
    detail: str = ""
    error: dict[str, Any] | None = None  # root cause the job printed (type, message)
    heartbeat: dict[str, Any] | None = None  # the current attempt's heartbeat, if it wrote one
    status: str = ""
    phase: str = ""  # the job's phase as its heartbeat reports it (``starting`` before the first one)

    @property
    def definitive(self) -> bool:
        return self.kind in DEFINITIVE

    @property
    def trouble(self) -> bool:
        return self.kind not in ("running", "succeeded")


def classify(
    view: JobView,
    attempt: Attempt,
    beat: dict[str, Any] | None,
    cfg: Config,
    now: float,
    address: str = "",
    error: dict[str, Any] | None = None,
) -> Verdict:
    """One observation -> a verdict."""
    sid = attempt.submission_id
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
    return stall_verdict(view.status, attempt, beat, cfg, now)


def stall_verdict(status: str, attempt: Attempt, beat: dict[str, Any] | None, cfg: Config, now: float) -> Verdict:
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
        f"Ray job {attempt.submission_id} is {status} but {what} for {quiet:.0f}s {at} "
        f"(fault_tolerance.{field}={limit:g})",
        heartbeat=beat,
        status=status,
        phase=phase,
    )


def phase_clock(attempt: Attempt, beat: dict[str, Any] | None, cfg: Config) -> tuple[str, float, float, str]:
    """(phase, since when, limit in seconds, config field) of the attempt as its heartbeat reports it. No heartbeat
    yet: ``starting``, from the submission. ``training``: from the last step. Older heartbeats have no phase."""
    ft = cfg.fault_tolerance
    if beat is None:
        return "starting", attempt.started_at, ft.phase_stall_s.starting, "phase_stall_s.starting"
    phase = beat.get("phase", "training")
    if phase == "training":
        since = max(beat["last_step_at"], beat.get("phase_started_at") or 0.0)
        return phase, since, ft.stall_timeout_s, "stall_timeout_s"
    key = "exporting" if phase == "done" else phase  # done: the driver still has to exit
    limit = getattr(ft.phase_stall_s, key, ft.stall_timeout_s)
    return phase, beat.get("phase_started_at") or beat["last_step_at"], limit, f"phase_stall_s.{key}"


def still_submitting(attempt: Attempt, cfg: Config, now: float) -> bool:
    """Whether a job the cluster does not know may simply not be submitted yet (recorded, never seen running, and
    younger than the stall limit). The flow records an attempt only once the run fits its cluster, right before it
    submits, so this window covers the submit call itself."""
    return attempt.status == "SUBMITTED" and now - attempt.started_at < cfg.fault_tolerance.stall_timeout_s
