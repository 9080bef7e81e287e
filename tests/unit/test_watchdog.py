"""Watchdog rules without a cluster: the storage lease, the restart policy, and who may write the registry when."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ray_jobs.config import load_config
from ray_jobs.storage import create_exclusive
from tasks import lease as leases
from tasks import registry
from tasks.watchdog import backoff_s, give_up_reason, still_submitting
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
    assert len([g for g in got if g is not None]) == 1


# -- the policy ----------------------------------------------------------------------------------------------
def incident(step: int | None, kind: str = "job-failed", error: dict | None = None, action: str | None = None):
    return {"kind": kind, "failed_step": step, "error": error, "action": action}


def test_backoff_doubles_and_is_capped(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.restart_backoff_s=10", "fault_tolerance.restart_backoff_max_s=35")
    assert [backoff_s(c, n) for n in range(4)] == [10, 20, 35, 35]


def test_an_infrastructure_failure_is_restarted_within_the_budget(tmp_path: Path) -> None:
    c = cfg(tmp_path, "fault_tolerance.max_restarts=2")
    now = incident(120, error={"type": "ActorDiedError", "kinds": ["ActorDiedError", "RayError", "Exception"]})
    assert give_up_reason({"restarts": 0, "incidents": [now]}, c, now) is None
    past = [incident(40, action="restarted"), incident(80, action="restarted")]
    reason = give_up_reason({"restarts": 2, "incidents": [*past, now]}, c, now)
    assert reason == "restart budget exhausted: 2 of fault_tolerance.max_restarts=2 restarts used"


def test_a_user_error_is_not_retried_even_as_a_subclass(tmp_path: Path) -> None:
    now = incident(10, error={"type": "NoMatchingPeftModuleError", "message": "Target modules not found",
                              "kinds": ["NoMatchingPeftModuleError", "ValueError", "Exception"]})  # fmt: skip
    reason = give_up_reason({"restarts": 0, "incidents": [now]}, cfg(tmp_path), now)
    assert reason.startswith("the job raised NoMatchingPeftModuleError: Target modules not found")


def test_the_same_step_failing_twice_is_deterministic(tmp_path: Path) -> None:
    boom = {"type": "RuntimeError", "kinds": ["RuntimeError", "Exception"]}
    first = incident(57, error=boom, action="restarted")
    again = incident(57, error=boom)
    reason = give_up_reason({"restarts": 1, "incidents": [first, again]}, cfg(tmp_path), again)
    assert reason.startswith("deterministic failure: 2 attempts in a row failed at step 57")
    moved_on = incident(90, error=boom)
    assert give_up_reason({"restarts": 1, "incidents": [first, moved_on]}, cfg(tmp_path), moved_on) is None


# -- who writes the registry ---------------------------------------------------------------------------------
def test_the_flow_does_not_overwrite_an_attempt_the_watchdog_already_dealt_with(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    # The watchdog saw the failure first and restarted the run as attempt 2.
    reg = registry.load(c.storage, "r")
    reg["attempts"][0].update(status="FAILED")
    reg["incidents"].append({"kind": "job-failed", "action": "restarted", "new_attempt": 2})
    registry.save(c.storage, "r", reg)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1", started_by="watchdog")
    # The flow's watch reports the same failure a moment later: nothing changes.
    assert registry.hand_over(c, 1, "ended FAILED", {"kind": "job-failed", "detected_by": "finetune-flow"}) is None
    reg = registry.load(c.storage, "r")
    assert len(reg["incidents"]) == 1 and reg["state"] == "submitted" and len(reg["attempts"]) == 2


def test_status_shows_incidents_with_their_cost(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    reg = registry.load(c.storage, "r")
    reg["incidents"].append(
        {"kind": "stalled", "attempt": 1, "detected_by": "watchdog", "detected_at": time.time(), "action": "restarted",
         "new_attempt": 2, "resumed_step": 80, "lost_steps": 17, "silent_s": 25.4, "time_to_recover_s": 12.0,
         "detail": "made no step for 25s"}
    )  # fmt: skip
    reg["restarts"] = 1
    registry.save(c.storage, "r", reg)
    text = registry.describe(c.storage, "r")
    assert "restarts: 1 of 3" in text
    assert (
        "stalled (attempt 1, by watchdog): restarted as attempt 2 from step 80; lost steps 17; "
        "silent 25.4s before detection; first new step 12.0s after detection" in text
    )
    assert "made no step for 25s" in text


def test_recoveries_and_give_ups_are_prefect_events_named_by_run(asserting_events) -> None:
    from prefect.events.worker import EventsWorker

    from flows.watchdog import emit
    from tasks.watchdog import Outcome

    emit(Outcome("r1", "restarted", "attempt 2 from step 80", {"kind": "stalled", "lost_steps": 3}))
    emit(Outcome("r2", "ok", "RUNNING, step 9"))  # nothing to tell
    emit(Outcome("r3", "gave-up", "restart budget exhausted", {"kind": "job-failed"}))
    EventsWorker.drain_all()
    events = [e for c in asserting_events.all for e in c.events]
    assert [(e.event, e.resource.id, e.resource.name) for e in events] == [
        ("unbroken.run.recovered", "unbroken.run.r1", "r1"),
        ("unbroken.run.gave-up", "unbroken.run.r3", "r3"),
    ]
    assert events[0].payload["incident"] == {"kind": "stalled", "lost_steps": 3}


@pytest.mark.parametrize(
    ("status", "age_s", "submitting"),
    [
        ("SUBMITTED", 5, True),  # recorded, the flow still writing the spec or running the preflight job
        ("SUBMITTED", 70, False),  # its submitter took longer than the stall limit: lost
        ("RUNNING", 5, False),  # seen running once: a 404 now means the cluster forgot it
    ],
)
def test_a_job_the_cluster_does_not_know_is_lost_only_once_it_should_have_been_submitted(
    tmp_path: Path, status: str, age_s: float, submitting: bool
) -> None:
    c = cfg(tmp_path, "fault_tolerance.stall_timeout_s=60")
    attempt = {"attempt": 1, "status": status, "started_at": 1000.0}
    assert still_submitting(attempt, c, now=1000.0 + age_s) is submitting
