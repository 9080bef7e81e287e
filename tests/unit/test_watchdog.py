"""Watchdog rules without a cluster: the storage lease, the restart policy, and who may write the registry when."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from control import lease as leases
from control import registry
from control.describe import describe
from control.jobsapi import JobView
from control.records.run import Attempt, Incident, RunRecord, Suspect
from control.watchdog.policy import backoff_s, budget_used, give_up_reason
from control.watchdog.suspects import cleared, confirm
from control.watchdog.verdict import Verdict, classify, still_submitting
from ray_jobs.config import load_config
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.coordination import create_exclusive
from tests.conftest import ROOT


def cfg(storage: Path, *overrides: str):
    return load_config(ROOT / "configs" / "demo.yaml", [f"storage={storage}", "name=r", *overrides])


# -- the lease -----------------------------------------------------------------------------------------------
def test_exclusive_create_has_exactly_one_winner(tmp_path: Path) -> None:
    url = str(tmp_path / "x" / "claim.json")
    results: list[bool] = []
    barrier = threading.Barrier(16)

    def race(i: int) -> None:
        barrier.wait()
        results.append(create_exclusive(url, str(i).encode()))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 15 + [True]


def test_lease_is_exclusive_until_released_or_expired(tmp_path: Path) -> None:
    storage = str(tmp_path)
    a = leases.acquire(storage, "r", owner="a", ttl_s=60)
    assert a is not None and a.generation == 1
    assert leases.acquire(storage, "r", owner="b") is None
    assert leases.holder(storage, "r")["owner"] == "a"
    a.release()
    b = leases.acquire(storage, "r", owner="b", ttl_s=0.2)
    assert b is not None and b.generation == 2
    time.sleep(0.3)  # b stalls past its expiry ...
    c = leases.acquire(storage, "r", owner="c", ttl_s=60)
    assert c is not None and c.generation == 3
    with pytest.raises(leases.LeaseLost):  # ... and is fenced off before it can act on a stale view
        b.check()
    c.check()
    c.release()
    assert sorted(p.name for p in (tmp_path / "runs" / "r" / "leases").iterdir()) == ["lease-00000003.json"]


def test_racing_watchdogs_get_one_lease(tmp_path: Path) -> None:
    got: list[leases.Lease | None] = []
    barrier = threading.Barrier(8)

    def race() -> None:
        barrier.wait()
        got.append(leases.acquire(str(tmp_path), "r", ttl_s=60))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8, "every racer gets an answer (a generation being written is a lease being taken)"
    assert len([g for g in got if g is not None]) == 1


# -- the policy ----------------------------------------------------------------------------------------------
def incident(step: int | None, kind: str = "job-failed", error: dict | None = None, action: str | None = None,
             **fields) -> Incident:  # fmt: skip
    base = {"kind": kind, "detected_by": "watchdog", "detected_at": 0.0, "attempt": 1, "failed_step": step,
            "error": error, "action": action}  # fmt: skip
    return Incident(**(base | fields))


def run(*incidents: Incident, restarts: int = 0) -> RunRecord:
    return RunRecord(name="r", restarts=restarts, incidents=list(incidents))


def test_backoff_doubles_and_is_capped(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.restart_backoff_s=10", "fault_tolerance.restart_backoff_max_s=35")
    assert [backoff_s(c, n) for n in range(4)] == [10, 20, 35, 35]


def test_an_infrastructure_failure_is_restarted_within_the_budget(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.max_restarts=2")
    now = incident(120, error={"type": "ActorDiedError", "kinds": ["ActorDiedError", "RayError", "Exception"]})
    assert give_up_reason(run(now, restarts=0), c, now) is None
    past = [incident(40, action="restarted"), incident(80, action="restarted")]
    reason = give_up_reason(run(*past, now, restarts=2), c, now)
    assert reason.startswith("restart budget exhausted: 2 of fault_tolerance.max_restarts=2 restarts used")


def test_a_user_error_is_not_retried_even_as_a_subclass(tmp_path: Path) -> None:
    now = incident(10, error={"type": "NoMatchingPeftModuleError", "message": "Target modules not found",
                              "kinds": ["NoMatchingPeftModuleError", "ValueError", "Exception"]})  # fmt: skip
    reason = give_up_reason(run(now, restarts=0), cfg(tmp_path), now)
    assert reason.startswith("the job raised NoMatchingPeftModuleError: Target modules not found")


def test_the_same_step_failing_twice_is_deterministic(tmp_path: Path) -> None:
    boom = {"type": "RuntimeError", "kinds": ["RuntimeError", "Exception"]}
    first = incident(57, error=boom, action="restarted")
    again = incident(57, error=boom)
    reason = give_up_reason(run(first, again, restarts=1), cfg(tmp_path), again)
    assert reason.startswith("deterministic failure: 2 attempts in a row failed at step 57")
    moved_on = incident(90, error=boom)
    assert give_up_reason(run(first, moved_on, restarts=1), cfg(tmp_path), moved_on) is None


# -- who writes the registry ---------------------------------------------------------------------------------
def restarted_by_the_watchdog(c) -> None:
    """Run ``r``'s attempt 1, whose failure the watchdog saw first: recorded failed, the run restarted as attempt 2."""
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    reg = registry.load(c.storage, "r")
    reg.attempts[0].status = "FAILED"
    reg.incidents.append(incident(None, action="restarted", new_attempt=2))
    registry.save(c.storage, "r", reg)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1", started_by="watchdog")


def test_the_flow_does_not_overwrite_an_attempt_the_watchdog_already_dealt_with(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    restarted_by_the_watchdog(c)
    # The flow's watch reports the same failure a moment later: nothing changes.
    assert registry.hand_over(c, 1, "ended FAILED", incident(None, detected_by="finetune-flow")) is None
    reg = registry.load(c.storage, "r")
    assert len(reg.incidents) == 1 and reg.state == "submitted" and len(reg.attempts) == 2


def test_status_shows_incidents_with_their_cost(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    reg = registry.load(c.storage, "r")
    reg.incidents.append(
        Incident(kind="stalled", attempt=1, detected_by="watchdog", detected_at=time.time(), action="restarted",
                 new_attempt=2, resumed_step=80, lost_steps=17, silent_s=25.4, time_to_recover_s=12.0,
                 detail="made no step for 25s")
    )  # fmt: skip
    reg.incidents.append(
        Incident(kind="api-unreachable", attempt=2, detected_by="watchdog", detected_at=time.time(),
                 action="observed", observations=7, detail="the Jobs API at http://x:8265 gave no answer")
    )  # fmt: skip
    reg.restarts = 1
    registry.save(c.storage, "r", reg)
    text = describe(c.storage, "r")
    assert "restarts: 1 of 3" in text
    assert "api-unreachable (attempt 2, by watchdog): observed, nothing done; still holds (7 looks)" in text
    assert (
        "stalled (attempt 1, by watchdog): restarted as attempt 2 from step 80; lost steps 17; "
        "silent 25.4s before detection; first new step 12.0s after detection" in text
    )
    assert "made no step for 25s" in text


def test_recoveries_and_give_ups_are_prefect_events_named_by_run(asserting_events) -> None:
    from prefect.events.worker import EventsWorker

    from control.watchdog import Outcome
    from flows.watchdog import emit

    stalled = Incident(kind="stalled", detected_by="watchdog", detected_at=1.0, attempt=1, lost_steps=3)
    emit(Outcome("r1", "restarted", "attempt 2 from step 80", stalled))
    emit(Outcome("r2", "ok", "RUNNING, step 9"))  # nothing to tell
    emit(Outcome("r3", "gave-up", "restart budget exhausted", incident(None)))
    EventsWorker.drain_all()
    events = [e for c in asserting_events.all for e in c.events]
    assert [(e.event, e.resource.id, e.resource.name) for e in events] == [
        ("unbroken.run.recovered", "unbroken.run.r1", "r1"),
        ("unbroken.run.gave-up", "unbroken.run.r3", "r3"),
    ]
    assert events[0].payload["incident"] == {"kind": "stalled", "detected_by": "watchdog", "detected_at": 1.0,
                                             "attempt": 1, "lost_steps": 3}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "age_s", "submitting"),
    [
        ("SUBMITTED", 5, True),  # recorded, the flow still writing the spec or submitting
        ("SUBMITTED", 70, False),  # its submitter took longer than the stall limit: lost
        ("RUNNING", 5, False),  # seen running once: a 404 now means the cluster forgot it
    ],
)
def test_a_job_the_cluster_does_not_know_is_lost_only_once_it_should_have_been_submitted(
    tmp_path: Path, status: str, age_s: float, submitting: bool
) -> None:
    c = cfg(tmp_path, "fault_tolerance.stall_timeout_s=60")
    attempt = Attempt(attempt=1, submission_id="s", started_by="finetune-flow", status=status, started_at=1000.0)
    assert still_submitting(attempt, c, now=1000.0 + age_s) is submitting


# -- observe: one look -> a verdict --------------------------------------------------------------------------
NOW = 10_000.0
ATTEMPT = Attempt(
    attempt=2, submission_id="unbroken-r-train-002", started_at=NOW - 500, status="RUNNING", started_by="watchdog"
)


def beat(phase: str | None, in_phase_s: float, last_step_ago_s: float, refreshed_ago_s: float = 1.0) -> Beat:
    b = {"run": "r", "attempt": 2, "max_steps": 100, "step": 40, "last_step_at": NOW - last_step_ago_s,
         "time": NOW - refreshed_ago_s}  # fmt: skip
    if phase is not None:
        b |= {"phase": phase, "phase_started_at": NOW - in_phase_s}
    return Beat.model_validate(b)


@pytest.mark.parametrize(
    ("view", "heartbeat", "kind", "definitive"),
    [
        (JobView("ok", "RUNNING"), beat("training", 100, 5), "running", False),
        (JobView("ok", "SUCCEEDED"), None, "succeeded", False),
        (JobView("ok", "FAILED", "worker died"), None, "job-failed", True),  # the API said so: act at once
        (JobView("ok", "STOPPED"), None, "job-failed", True),
        (JobView("unknown", why="HTTP 502 from the Jobs API"), None, "cluster-unreachable", False),  # a blip?
        (JobView("unknown", why="HTTP 401 from the Jobs API"), None, "cluster-unreachable", False),
        (JobView("unknown", why="ReadTimeout"), None, "cluster-unreachable", False),
        (JobView("missing", why="no such job"), None, "job-lost", False),  # seen running, now unknown: confirm
        (JobView("ok", "RUNNING"), beat("training", 100, 61), "stalled", True),  # no step for > stall limit
        (JobView("ok", "RUNNING"), beat("exporting", 300, 400), "running", False),  # a long export is no stall
        (JobView("ok", "RUNNING"), beat("evaluating", 200, 250), "running", False),
        # frozen, dead, or storage away: a silent heartbeat is confirmed before it is acted on
        (JobView("ok", "RUNNING"), beat("exporting", 100, 150, refreshed_ago_s=70), "stalled", False),
        # the Jobs API cannot tell, but the heartbeat is fresh: the API is what failed, the job trains on
        (JobView("unknown", why="ConnectionError"), beat("training", 100, 5), "api-unreachable", False),
        (JobView("missing", why="no such job"), beat("training", 100, 5), "api-unreachable", False),
        (
            JobView("unknown", why="ConnectionError"),
            beat("training", 100, 5, refreshed_ago_s=30),
            "cluster-unreachable",
            False,
        ),  # fmt: skip
        # Ray says FAILED after the job's rank 0 exported its final model: it succeeded
        (JobView("ok", "FAILED"), beat("done", 1, 5), "succeeded", False),
        (JobView("unknown", why="ConnectionError"), beat("done", 1, 5, refreshed_ago_s=300), "succeeded", False),
        (JobView("ok", "RUNNING"), beat("loading", 1801, 1801), "stalled", True),  # over the loading limit
        (JobView("ok", "RUNNING"), beat(None, 0, 61), "stalled", True),  # an older job's heartbeat: no phases
        (JobView("ok", "PENDING"), None, "running", False),  # starting: 500 s < phase_stall_s.starting
        # Ray Train restarts the group in the job: its controller wrote that once; nothing beats until the new group
        # does, which may take longer than stall_timeout_s: judged as starting is
        (JobView("ok", "RUNNING"), beat("restarting", 100, 150, refreshed_ago_s=100), "running", False),
        (JobView("ok", "RUNNING"), beat("restarting", 1801, 1900, refreshed_ago_s=1801), "stalled", False),
        # its final model exported, its rank 0 gone quiet: the driver is still leaving -- judged as an export is
        (JobView("ok", "RUNNING"), beat("done", 100, 90, refreshed_ago_s=90), "running", False),
        (JobView("ok", "RUNNING"), beat("done", 3700, 3700, refreshed_ago_s=3700), "stalled", False),
    ],
)
def test_one_look_is_classified_by_what_the_api_and_the_heartbeat_say(
    tmp_path: Path, view, heartbeat, kind: str, definitive: bool
) -> None:
    c = cfg(tmp_path, "fault_tolerance.stall_timeout_s=60")
    verdict = classify(view, ATTEMPT, heartbeat, c, NOW)
    assert (verdict.kind, verdict.definitive) == (kind, definitive), verdict.detail


def test_a_stall_names_the_phase_and_the_limit_that_fired(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.phase_stall_s.exporting=120")
    verdict = classify(JobView("ok", "RUNNING"), ATTEMPT, beat("exporting", 130, 140), c, NOW)
    assert verdict.kind == "stalled" and verdict.phase == "exporting"
    assert "was in phase 'exporting' for 130s" in verdict.detail and "phase_stall_s.exporting=120" in verdict.detail
    starting = classify(JobView("ok", "PENDING"), ATTEMPT.model_copy(update={"started_at": NOW - 2000}), None, c, NOW)
    assert starting.kind == "stalled" and "phase_stall_s.starting" in starting.detail


# -- decide: ambiguous signs are confirmed over time ---------------------------------------------------------
def a_run() -> RunRecord:
    return RunRecord(name="r", attempts=[ATTEMPT.model_copy()], state="running")


def test_an_ambiguous_sign_is_acted_on_only_once_it_held_for_the_confirmation_window(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.confirm_s=30")
    reg, blip = a_run(), Verdict("cluster-unreachable", "HTTP 502")
    assert [confirm(reg, blip, c, NOW + t) for t in (0, 10, 29)] == ["suspect"] * 3
    assert confirm(reg, blip, c, NOW + 31) == "trouble"
    assert reg.suspect.observations == 4 and reg.suspect.first_at == NOW


def test_one_look_is_not_enough_however_long_ago_the_first_was(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.confirm_s=30")
    reg = a_run()
    reg.suspect = Suspect(kind="job-lost", attempt=2, first_at=NOW - 100, observations=0)
    assert confirm(reg, Verdict("job-lost", "404"), c, NOW) == "suspect"  # the first real look
    assert confirm(reg, Verdict("job-lost", "404"), c, NOW + 1) == "trouble"


def test_a_definitive_sign_is_acted_on_at_once(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.confirm_s=30")
    reg = a_run()
    assert confirm(reg, Verdict("job-failed", "FAILED"), c, NOW) == "trouble"
    assert confirm(reg, Verdict("stalled", "no step"), c, NOW) == "trouble"


def test_a_blip_that_heals_is_logged_as_observed_not_acted_on(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.confirm_s=30")
    reg = a_run()
    for t in (0, 5, 10):
        confirm(reg, Verdict("cluster-unreachable", "HTTP 502 from the Jobs API"), c, NOW + t)
    assert confirm(reg, Verdict("running", status="RUNNING"), c, NOW + 20) == "healthy"
    entry = cleared(reg, NOW + 20, "healthy again (RUNNING)")
    assert reg.suspect is None and "suspect" not in reg.dump() and reg.incidents == [entry]
    assert entry.action == "observed" and entry.observations == 3 and entry.held_s == 20
    assert reg.open_incident() is None  # nothing for the watchdog to act on


def test_a_different_sign_starts_its_own_window(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.confirm_s=30")
    reg = a_run()
    confirm(reg, Verdict("cluster-unreachable", "502"), c, NOW)
    confirm(reg, Verdict("job-lost", "404"), c, NOW + 40)
    assert reg.suspect.kind == "job-lost" and reg.suspect.first_at == NOW + 40


# -- budgets -------------------------------------------------------------------------------------------------
def restarted(progress: int, **extra) -> Incident:
    return incident(extra.pop("failed_step", None), action="restarted", progress_steps=progress, **extra)


@pytest.mark.parametrize(
    ("history", "progress_now", "used"),
    [
        ([restarted(5), restarted(5)], 5, 2),  # no progress: every restart counts
        ([restarted(5), restarted(150), restarted(5)], 5, 2),  # the 150-step attempt reset the count
        ([restarted(5), restarted(5)], 120, 0),  # this attempt itself trained 100+ steps
        ([restarted(5, error={"type": "Preempted", "preempted": True}), restarted(5)], 5, 1),  # not counted
        ([restarted(5, kind="preempted")] * 3, 5, 0),
    ],
)
def test_restarts_are_counted_per_window_of_progress_without_preemptions(
    tmp_path: Path, history: list, progress_now: int, used: int
) -> None:
    c = cfg(tmp_path, "fault_tolerance.progress_resets_budget_steps=100")
    now = incident(None, progress_steps=progress_now)
    assert budget_used(run(*history, now), c, now) == used


def test_a_week_of_preemptions_with_progress_never_gives_up(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.max_restarts=2", "fault_tolerance.progress_resets_budget_steps=50")
    history = [restarted(60, failed_step=60 * (i + 1)) for i in range(20)]
    now = incident(60 * 21, progress_steps=60)
    assert give_up_reason(run(*history, now, restarts=20), c, now) is None
    preempt = incident(5, error={"type": "Preempted"})
    stuck = [restarted(0, failed_step=5, error={"type": "Preempted"})] * 5
    assert give_up_reason(run(*stuck, preempt), c, preempt) is None


PREEMPTED = {"type": "Preempted", "preempted": True}


@pytest.mark.parametrize(
    ("max_preemptions", "history", "gives_up"),
    [
        (-1, [restarted(0, failed_step=5, error=PREEMPTED)] * 30, False),  # unlimited: spot capacity comes back
        (3, [restarted(0, failed_step=5, error=PREEMPTED)] * 2, False),
        (3, [restarted(0, failed_step=5, error=PREEMPTED)] * 3, True),  # bounded: an endless eviction loop ends
        (3, [restarted(0, failed_step=5, error=PREEMPTED)] * 2 + [restarted(200)] * 5, False),  # progress resets
    ],
)
def test_preemptions_are_bounded_by_their_own_budget_and_back_off(
    tmp_path: Path, max_preemptions: int, history: list, gives_up: bool
) -> None:
    c = cfg(tmp_path, f"fault_tolerance.max_preemptions={max_preemptions}", "fault_tolerance.max_restarts=1",
            "fault_tolerance.progress_resets_budget_steps=100", "fault_tolerance.restart_backoff_s=2")  # fmt: skip
    now = incident(5, error=PREEMPTED)
    reason = give_up_reason(run(*history, now), c, now)
    assert (reason is not None) == gives_up, reason
    if gives_up:
        assert reason.startswith("preemption budget exhausted: 3 of fault_tolerance.max_preemptions=3")
    used = budget_used(run(*history, now), c, now)
    assert backoff_s(c, used) == min(2 * 2**used, 600), "each preemption in a row waits twice as long"


def test_restarts_that_could_not_complete_count_and_end_in_a_give_up_naming_why(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.max_restarts=2")
    now = incident(5, failed_tries=2, last_try_error="StopUnverified: the Ray cluster at http://h:8265 does not answer")
    reason = give_up_reason(run(now), c, now)
    assert reason.startswith("restart budget exhausted: 2 of fault_tolerance.max_restarts=2")
    assert "2 restart(s) could not complete, the last: StopUnverified: the Ray cluster at http://h:8265" in reason


def test_ray_trains_controller_marks_a_group_restart_in_the_heartbeat(tmp_path: Path) -> None:
    """The callback every job passes Ray Train (ray_jobs/job.py): when a worker of the group fails, the heartbeat
    says ``restarting`` from now, its progress kept; a job that already exported its final model is left as it was."""
    import json

    from ray_jobs.storage import Layout
    from ray_jobs.train.heartbeat import group_restarts

    c = cfg(tmp_path)
    url = Path(Layout(c.storage).heartbeat(c.name))
    url.parent.mkdir(parents=True, exist_ok=True)
    url.write_text(json.dumps(beat("training", 100, 5).set(pid=1).dump()))
    callback = group_restarts(c)
    callback.after_exception(None, {0: RuntimeError("worker died")})
    written = json.loads(url.read_text())
    assert written["phase"] == "restarting" and written["step"] == 40 and written["pid"] != 1
    assert written["phase_started_at"] == written["time"] > NOW
    url.write_text(json.dumps(beat("done", 1, 5).dump()))
    callback.after_exception(None, {0: RuntimeError("worker died")})
    assert json.loads(url.read_text())["phase"] == "done"
    url.unlink()
    callback.after_exception(None, {0: RuntimeError("worker died")})  # no heartbeat yet: nothing raised into Ray Train
    assert not url.exists()


def test_verdict_kinds_have_one_list_and_each_one_group() -> None:
    from typing import get_args

    from control.watchdog.verdict import AMBIGUOUS, DEFINITIVE, FINE, VerdictKind

    groups = [*DEFINITIVE, *AMBIGUOUS, *FINE]
    assert sorted(groups) == sorted(get_args(VerdictKind)) and len(set(groups)) == len(groups)


CLOSINGS = [  # (cluster.keep_running, the release raises) -> what closing released
    (False, False),
    (True, False),  # kept: nothing released, the run closed all the same
    (False, True),  # the release fails after the run was scored
]  # fmt: skip


@pytest.mark.parametrize(("keep", "fails"), CLOSINGS)
def test_a_succeeded_run_is_closed_one_way_by_its_flow_or_by_the_watchdog(tmp_path, monkeypatch, keep, fails) -> None:
    """The flow's record-success and the watchdog's CloseRun both close through control/attempt.close_run: scored
    in the series first, then the cluster released unless kept. A release that fails leaves the flow's run to be
    closed again (by the flow's release-cluster, or the watchdog after its grace); the watchdog logs past it and
    closes the run, as a release of a cluster the run did not bring up is left alone."""
    from control import attempt
    from control.backends import handle_from_record
    from control.backends.base import ClusterError
    from control.watchdog.act import act
    from control.watchdog.decide import CloseRun, Decision, Outcome, Save
    from tasks.record import record_success

    calls: list[str] = []
    monkeypatch.setattr(attempt.series, "finish_run", lambda storage, run: calls.append(f"score {run}"))

    def release(cfg, handle, run) -> None:
        calls.append(f"release {run}")
        if fails:
            raise ClusterError("the cluster does not answer")

    monkeypatch.setattr(attempt, "release", release)
    for who in ("flow", "watchdog"):
        c = cfg(tmp_path / who, "cluster.address=http://x:8265", f"cluster.keep_running={keep}")
        calls.clear()
        registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
        if who == "flow":
            handle = handle_from_record(registry.load(c.storage, "r").recorded_cluster)
            try:
                record_success.fn(c, 1, "/final", handle)
            except ClusterError:
                assert fails
        else:
            registry.end_attempt(c, 1, "SUCCEEDED", final_model="/final")
            reg = registry.load(c.storage, "r")
            reg.unset("closing_since")
            act(Decision(reg, [CloseRun(), Save()], Outcome("r", "closed")), c, leases.acquire(c.storage, "r", 60))
        assert calls == ["score r"] + ([] if keep else ["release r"]), (who, calls)
        reg = registry.load(c.storage, "r")
        assert reg.state == "succeeded" and reg.final_model == "/final"
        assert (reg.closing_since is None) == (who == "watchdog" or not fails), (who, reg.closing_since)


def test_a_flow_whose_attempt_the_watchdog_dealt_with_leaves_the_closing_to_it(tmp_path, monkeypatch) -> None:
    """The flow's job succeeded after the watchdog had recorded its attempt failed and restarted the run: the flow
    scores nothing and releases nothing -- the new attempt may be training on that cluster."""
    from control import attempt
    from control.backends import handle_from_record
    from tasks.record import record_success

    calls: list[str] = []
    monkeypatch.setattr(attempt.series, "finish_run", lambda storage, run: calls.append("score"))
    monkeypatch.setattr(attempt, "release", lambda cfg, handle, run: calls.append("release"))
    c = cfg(tmp_path, "cluster.address=http://x:8265")
    restarted_by_the_watchdog(c)
    handle = handle_from_record(registry.load(c.storage, "r").recorded_cluster)
    assert record_success.fn(c, 1, "/final", handle) is None
    reg = registry.load(c.storage, "r")
    assert calls == [] and reg.state == "submitted" and reg.current.status != "SUCCEEDED"


def test_a_restart_whose_submission_fails_is_a_counted_try_and_the_next_pass_restarts_again(
    tmp_path: Path, monkeypatch
) -> None:
    """The new attempt is recorded, then the Jobs API refuses its submission: the attempt ends FAILED (not
    "still submitting": the pass after would have found the missing job healthy and closed the incident, uncounted)
    and the try counts -- the next pass restarts again after its backoff, and a refusal that persists ends in a
    give-up that names it."""
    from types import SimpleNamespace

    from control.backends.base import ClusterHandle
    from control.jobsapi import JobView
    from control.records.run import Incident
    from control.watchdog import restart
    from control.watchdog.decide import Resubmit, decide, recheck
    from control.watchdog.observe import Observations

    c = cfg(tmp_path, "fault_tolerance.max_restarts=2", "fault_tolerance.restart_backoff_s=1")
    registry.begin_attempt(c, {"address": "http://h:8265"}, "ds-1", AttemptInputs(manifest_url="m", model_path="p"))
    registry.end_attempt(c, 1, "FAILED", "boom", state="recovering")
    reg = registry.load(c.storage, "r")
    reg.incidents.append(Incident(kind="job-failed", detected_by="watchdog", detected_at=0.0, attempt=1))
    registry.save(c.storage, "r", reg)

    def refused(*a, **k):
        raise RuntimeError("the Jobs API refused the submission: 503 Service Unavailable")

    monkeypatch.setattr(restart, "submit", refused)
    lease = SimpleNamespace(check=lambda: None, kept=contextlib.nullcontext)
    handle = ClusterHandle("http://h:8265", "http://h:8265", False, "python")
    for tries in (1, 2):
        reg = registry.load(c.storage, "r")
        outcome = restart._resubmit(c, reg, reg.open_incident(), handle, lease)
        assert outcome.action == "restart-failed" and "503 Service Unavailable" in outcome.detail
        reg = registry.load(c.storage, "r")
        assert (reg.state, reg.restarts, reg.open_incident().failed_tries) == ("recovering", 0, tries)
        assert reg.current.status == "FAILED" and "its submission failed" in reg.current.message
        # the next look finds no such job: trouble, not a submission still on its way -- restarted again
        again = Observations(time.time(), JobView("missing", why="no such job"))
        assert any(isinstance(a, Resubmit) for a in recheck(reg, again, c).actions)
    gave_up = decide(reg, Observations(time.time() + 3600, None), c)
    assert gave_up.outcome.action == "gave-up" and "503 Service Unavailable" in gave_up.record.reason


def test_the_flows_watch_re_attaches_a_driver_lost_while_its_run_host_trains_on(tmp_path: Path, monkeypatch) -> None:
    """``fault_tolerance.run_host``: the flow's watch saw its job end FAILED. Its driver died without a word while
    the heartbeat is fresh: a driver re-attaches under a new submission id (``--attach``), the attempt goes on, its
    first driver kept; a driver that printed a root cause failed indeed (handed over), as does any run without a host."""
    import json

    from control.watchdog import reattach
    from ray_jobs.storage import Layout

    c = cfg(tmp_path, "fault_tolerance.run_host=true")
    registry.begin_attempt(c, {"address": "http://h:8265"}, "ds-1", AttemptInputs(manifest_url="m", model_path="p"))
    url = Path(Layout(c.storage).heartbeat(c.name))
    url.parent.mkdir(parents=True, exist_ok=True)
    url.write_text(json.dumps(beat("training", 1, 1).set(attempt=1, time=time.time()).dump()))
    first = registry.load(c.storage, c.name).current.submission_id
    submitted = []
    monkeypatch.setattr(reattach.jobsapi, "read_job", lambda address, sid: JobView("ok", "FAILED"))
    monkeypatch.setattr(reattach, "submit", lambda handle, sid, module, spec, env, flags, code: submitted.append(flags))
    failure = JobFailure(type="RuntimeError", message="NCCL aborted", kinds=["RuntimeError"])
    monkeypatch.setattr(reattach, "job_failure", lambda address, sid: failure)
    assert reattach.reattach_watched(c, 1, first) is None and not submitted  # the training failed: handed over
    monkeypatch.setattr(reattach, "job_failure", lambda address, sid: None)
    assert reattach.reattach_watched(cfg(tmp_path, "fault_tolerance.run_host=false"), 1, first) is None  # no host
    sid = reattach.reattach_watched(c, 1, first)
    reg = registry.load(c.storage, c.name)
    assert sid == f"{first}-d2" == reg.current.submission_id and reg.current.drivers == [first]
    assert submitted == [("--attach",)] and reg.current.in_flight and len(reg.attempts) == 1 and reg.restarts == 0
    assert reattach.reattach_watched(c, 1, first) == sid and len(submitted) == 1  # a watchdog's re-attach: watched on


def test_a_running_job_whose_drivers_node_the_cluster_lists_dead_is_a_lost_driver_of_a_hosted_run(
    tmp_path: Path, monkeypatch
) -> None:
    """The flow's look after a head restarted under GCS fault tolerance: RUNNING to the Jobs API, but the node its
    driver ran on is dead -- a lost driver while the run host trains on (a fresh heartbeat); its node alive, or no
    run host, or the heartbeat stale: not."""
    import json

    from control.backends.health import Health, Node
    from control.watchdog import reattach
    from ray_jobs.storage import Layout

    c = cfg(tmp_path, "fault_tolerance.run_host=true")
    registry.begin_attempt(c, {"address": "http://h:8265"}, "ds-1", AttemptInputs(manifest_url="m", model_path="p"))
    url = Path(Layout(c.storage).heartbeat(c.name))
    url.parent.mkdir(parents=True, exist_ok=True)
    url.write_text(json.dumps(beat("training", 1, 1).set(attempt=1, time=time.time()).dump()))
    nodes = [Node("old-head", "10.0.0.1", False, True), Node("worker", "10.0.0.2", True, False)]

    class Backend:
        def health(self, handle):
            return Health(nodes)

    monkeypatch.setattr(reattach, "backend_for", lambda cfg: Backend())
    on = {"old-head": True, "worker": False}
    for node, lost in on.items():
        monkeypatch.setattr(reattach.jobsapi, "read_job", lambda a, s, n=node: JobView("ok", "RUNNING", driver_node=n))
        assert reattach.driver_lost(c, registry.load(c.storage, c.name)) is lost, node
    no_host = cfg(tmp_path, "fault_tolerance.run_host=false")
    assert not reattach.driver_lost(no_host, registry.load(c.storage, c.name)), "no run host"
