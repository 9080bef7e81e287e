"""What one look at a run's current attempt means: a :class:`Verdict` from the Jobs API's answer and the job's
heartbeat. Pure functions of what was observed (no I/O), shared by ``observe`` (to know what else to read) and
``decide``.

Two channels see a job, and either can fail on its own: the Jobs API (a port-forward, a VPN, a dashboard, a token on
this host) and the heartbeat rank 0 writes to storage. Neither is taken alone as proof that a job is gone: a fresh
heartbeat vetoes "unreachable" and "lost" (the API is what fails then: ``api-unreachable``, observed, never acted
on), and a heartbeat that went silent is itself only a sign to confirm (its process may be frozen or dead, or the
storage away for everyone). Freshness is the heartbeat's age by the storage's own clock (``beat_age_s``: when the
storage stamped the file, against the storage's now), and how long training has been quiet is measured on the job's
own clock plus that age -- never the cluster's clock against the watchdog's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from control.backends.health import Health
from control.jobsapi import JobView
from control.records.run import Attempt
from ray_jobs.config import Config
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.heartbeat import Beat

# What one look can conclude: the one list of verdict kinds, each in exactly one of the three groups below
# (tests/unit/test_watchdog.py checks it); a new kind is one more name here and in its group, and ty checks every
# Verdict made against it.
VerdictKind = Literal[
    "running",
    "succeeded",
    "api-unreachable",
    "driver-lost",
    "job-failed",
    "stalled",
    "cluster-unreachable",
    "job-lost",
]
# Kinds of trouble that are facts (the Jobs API said so; the job's own heartbeat says it is stuck): acted on at once.
DEFINITIVE: tuple[VerdictKind, ...] = ("job-failed", "stalled")
# Kinds that may be a blip of the observer's path (a proxy's 502, a restarting dashboard, an auth hiccup): acted on
# only once they held for fault_tolerance.confirm_s (control/confirm.py).
AMBIGUOUS: tuple[VerdictKind, ...] = ("cluster-unreachable", "job-lost")
# Looks that are no trouble at all: the job runs, or its API fails while its heartbeat says it trains on, or its driver
# is gone while its run host trains on (a driver is re-attached: ray_jobs/host.py).
FINE: tuple[VerdictKind, ...] = ("running", "succeeded", "api-unreachable", "driver-lost")


@dataclass
class Verdict:
    """What the watchdog sees for the current attempt."""

    kind: VerdictKind
    detail: str = ""
    error: JobFailure | None = None  # root cause the job printed
    heartbeat: Beat | None = None  # the current attempt's heartbeat, if it wrote one
    status: str = ""
    phase: str = ""  # the job's phase as its heartbeat reports it (``starting`` before the first one)
    silent: bool = False  # a stall seen only as a heartbeat gone quiet: to be confirmed like an ambiguous sign
    gone: bool = False  # the backend's own evidence: no process of the job is left (a sign that needs no confirming)

    @property
    def definitive(self) -> bool:
        return (self.kind in DEFINITIVE and not self.silent) or self.gone

    @property
    def trouble(self) -> bool:
        return self.kind not in FINE


def fresh_s(cfg: Config) -> float:
    """How old a heartbeat may be and still prove its job alive: two missed beats, and a little slack for a slow
    write. (A dead job's heartbeat stays "fresh" this long: detecting a lost cluster waits this much more.)"""
    return 3 * cfg.fault_tolerance.heartbeat_every_s + 2.0


def heartbeat_age(beat: Beat | None, now: float, beat_age_s: float | None) -> float | None:
    """The heartbeat's age by the storage's clock; without one observed (a caller that has only the file's content),
    its own ``time`` against ``now``."""
    if beat is None:
        return None
    return beat_age_s if beat_age_s is not None else max(0.0, now - beat.time)


def classify(
    view: JobView,
    attempt: Attempt,
    beat: Beat | None,
    cfg: Config,
    now: float,
    address: str = "",
    error: JobFailure | None = None,
    beat_age_s: float | None = None,
    job_gone: bool | None = None,
    driver_dead: bool = False,
) -> Verdict:
    """One observation -> a verdict. ``job_gone``: the backend's own evidence, asked only when the Jobs API cannot
    tell, that no process of the job is left (a local head's host: its process table) -- with the heartbeat quiet too,
    two channels agree and the silent API is acted on at once, not after ``confirm_s``. ``driver_dead``: the
    cluster's node table lists the node of a running job's driver dead (:func:`driver_dead`)."""
    sid = attempt.submission_id
    age = heartbeat_age(beat, now, beat_age_s)
    if view.api != "ok":
        return _unanswered(view, attempt, beat, cfg, now, address, age, job_gone)
    if view.status == "SUCCEEDED":
        return Verdict("succeeded", status=view.status, heartbeat=beat)
    if view.status in ("FAILED", "STOPPED"):
        return _ended(view, sid, beat, cfg, age, error)
    if driver_dead and hosted(view, beat, cfg, age, None, driver_dead=True):
        assert beat is not None and age is not None, "hosted() holds only with a heartbeat"
        why = f"is {view.status} to the Jobs API, but the node its driver ran on is dead (a head restarted without it)"
        return _driver_lost(view, sid, beat, age, why)
    return stall_verdict(view.status, attempt, beat, cfg, now, age)


def driver_dead(view: JobView, health: Health | None) -> bool:
    """Whether the node the job's driver ran on is dead by the cluster's own node table. A head restarted under GCS
    fault tolerance finds its jobs where it left them: one whose driver died with the old head stays RUNNING to its
    Jobs API (Ray 2.60 marks it failed only once a job is next submitted), while its node is listed dead."""
    if not view.driver_node or health is None or health.nodes is None:
        return False
    return any(n.node_id == view.driver_node and not n.alive for n in health.nodes)


def _ended(
    view: JobView, sid: str, beat: Beat | None, cfg: Config, age: float | None, error: JobFailure | None
) -> Verdict:
    """The Jobs API says the job ended FAILED or STOPPED: after its final model (succeeded), with its driver lost
    while its run host trains on, or failed."""
    if beat is not None and beat.phase == "done":  # its rank 0 exported the final model, then it ended
        return Verdict(
            "succeeded",
            f"Ray job {sid} ended {view.status} after its final model was exported",
            status=view.status,
            heartbeat=beat,
        )
    if hosted(view, beat, cfg, age, error):
        assert beat is not None and age is not None, "hosted() holds only with a heartbeat"
        return _driver_lost(view, sid, beat, age, f"ended {view.status} without a word")
    detail = f"Ray job {sid} ended {view.status}: {view.message or ''}".strip()
    if error:
        detail += f" [{error.type}: {error.message}]"
    return Verdict("job-failed", detail, error=error, heartbeat=beat, status=view.status)


def _driver_lost(view: JobView, sid: str, beat: Beat, age: float, why: str) -> Verdict:
    return Verdict(
        "driver-lost",
        f"Ray job {sid} {why}, but its run host trains on (heartbeat at step {beat.step}, written {age:.0f}s ago): "
        "a driver re-attaches",
        heartbeat=beat,
        status=view.status,
        phase=beat.judged_phase,
    )


def hosted(
    view: JobView,
    beat: Beat | None,
    cfg: Config,
    age: float | None,
    error: JobFailure | None,
    driver_dead: bool = False,
) -> bool:
    """The job's driver died while the attempt's run host trains on (``fault_tolerance.run_host``; its heartbeat
    fresh): the Jobs API says FAILED and the driver printed no root cause (a driver that relays its host's failure
    does), or the job is not ended to the Jobs API but the node its driver ran on is dead (:func:`driver_dead`)."""
    if not cfg.hosted or error is not None:
        return False
    if view.status != "FAILED" and not (driver_dead and not view.terminal):
        return False
    return beat is not None and age is not None and age <= fresh_s(cfg)


def _unanswered(
    view: JobView,
    attempt: Attempt,
    beat: Beat | None,
    cfg: Config,
    now: float,
    address: str,
    age: float | None,
    job_gone: bool | None,
) -> Verdict:
    """The Jobs API cannot tell (no answer, or it does not know the job): what the other channels make of it."""
    job_gone = job_gone and attempt.status != "SUBMITTED"  # never seen yet: its processes may not be started yet
    if beat is not None and beat.phase == "done":  # everything it owed is on storage: its heartbeat says so
        return Verdict(
            "succeeded",
            f"the Jobs API cannot tell ({view.why}), but the job's heartbeat says it exported its final model",
            status="SUCCEEDED",
            heartbeat=beat,
        )
    if view.api == "missing" and still_submitting(attempt, cfg, now):
        return Verdict("running", status="SUBMITTING", heartbeat=beat)
    why = f"the Jobs API at {address} gave no answer ({view.why})" if view.api == "unknown" else view.why
    if beat is not None and age is not None and age <= fresh_s(cfg):  # alive (an age comes only with a heartbeat)
        return _api_fails(why, beat, age)
    if view.api == "unknown":
        return Verdict(
            "cluster-unreachable",
            f"the Jobs API at {address} gave no answer: {view.why}{_gone(job_gone)}",
            heartbeat=beat,
            gone=bool(job_gone),
        )
    return Verdict("job-lost", f"{view.why}{_gone(job_gone)}", heartbeat=beat, gone=bool(job_gone))


def _gone(job_gone: bool | None) -> str:
    return "; no process of the job is left on its host (the backend's own evidence)" if job_gone else ""


def _api_fails(why: str, beat: Beat, age: float) -> Verdict:
    """The Jobs API cannot tell, but the job's heartbeat is fresh: the job trains on; the API is what failed."""
    return Verdict(
        "api-unreachable",
        f"{why}; the job's heartbeat is fresh (step {beat.step}, written {age:.0f}s ago): it trains on",
        heartbeat=beat,
        phase=beat.judged_phase,
    )


def stall_verdict(
    status: str, attempt: Attempt, beat: Beat | None, cfg: Config, now: float, age: float | None = None
) -> Verdict:
    """PENDING or RUNNING: moving, or hung in its phase? Each phase has its own limit (a multi-GB export is not a
    training step). With a heartbeat, time is the job's own: how long it has been quiet is its ``time`` minus when the
    phase or the last step began (one clock), plus the file's age (the storage's clock). A heartbeat that stopped
    being written means a frozen or dead process -- or storage away for everyone: silent, confirmed before it is acted
    on (the job catches its heartbeat up once storage is back)."""
    age = heartbeat_age(beat, now, age)
    phase, since, limit, field = phase_clock(attempt, beat, cfg)
    quiet = now - since if beat is None or age is None else beat.time - since + age  # (age is None iff beat is)
    stall_s = cfg.fault_tolerance.stall_timeout_s
    # Beats that end by design: ``restarting`` is written once by Ray Train's controller (no process beats until the
    # new group does); after ``done`` rank 0's writer has finished while the driver is still leaving (on a loaded host
    # longer than stall_timeout_s: restarting a job that owes nothing would train nothing and run it twice)
    if phase in ("restarting", "done"):
        stall_s = max(stall_s, limit)
    if beat is not None and age is not None and age > stall_s:  # frozen (SIGSTOP, a dead host), dead, or storage away
        at = f"at step {beat.step}"
        return Verdict(
            "stalled",
            f"Ray job {attempt.submission_id} is {status} but its heartbeat was last written "
            f"{age:.0f}s ago, {at} in phase {phase!r} (fault_tolerance.stall_timeout_s={stall_s:g})",
            heartbeat=beat,
            status=status,
            phase=phase,
            silent=True,
        )
    if quiet <= limit:
        return Verdict("running", status=status, heartbeat=beat, phase=phase)
    at = f"at step {beat.step}" if beat else "before its first heartbeat"
    what = "made no step" if phase == "training" else f"was in phase {phase!r}"
    return Verdict(
        "stalled",
        f"Ray job {attempt.submission_id} is {status} but {what} for {quiet:.0f}s {at} "
        f"(fault_tolerance.{field}={limit:g})",
        heartbeat=beat,
        status=status,
        phase=phase,
    )


def phase_clock(attempt: Attempt, beat: Beat | None, cfg: Config) -> tuple[str, float, float, str]:
    """(phase, since when, limit in seconds, config field) of the attempt as its heartbeat reports it. No heartbeat
    yet: ``starting``, from the submission. ``training``: from the last step. Older heartbeats have no phase."""
    ft = cfg.fault_tolerance
    if beat is None:
        return "starting", attempt.started_at, ft.phase_stall_s.starting, "phase_stall_s.starting"
    phase = beat.judged_phase
    if phase == "training":
        since = max(beat.last_step_at, beat.phase_started_at or 0.0)
        return phase, since, ft.stall_timeout_s, "stall_timeout_s"
    # done: the driver still has to exit; restarting: Ray Train starts the group again, as at the job's start
    key = {"done": "exporting", "restarting": "starting"}.get(phase, phase)
    limit = getattr(ft.phase_stall_s, key, ft.stall_timeout_s)
    return phase, beat.phase_started_at or beat.last_step_at, limit, f"phase_stall_s.{key}"


def still_submitting(attempt: Attempt, cfg: Config, now: float) -> bool:
    """Whether a job the cluster does not know may simply not be submitted yet (recorded, never seen running, and
    younger than the stall limit). The flow records an attempt only once the run fits its cluster, right before it
    submits, so this window covers the submit call itself."""
    return attempt.status == "SUBMITTED" and now - attempt.started_at < cfg.fault_tolerance.stall_timeout_s
