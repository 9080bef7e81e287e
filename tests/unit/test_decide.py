"""The watchdog's decisions as a table: a run record and one pass's observations in, the record as it should be,
the actions and the outcome out -- every verdict the watchdog can reach, each chaos scenario's situation as a row.
No cluster, no storage, no clock: ``decide`` is pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from control.backends.health import Health, Node
from control.jobsapi import JobView
from control.records.run import Attempt, ClusterRecord, Incident, RunRecord, Suspect
from control.watchdog.decide import (
    CloseRun,
    GiveUp,
    Log,
    Reattach,
    ReleaseCluster,
    ReplaceNodes,
    Restart,
    Resubmit,
    Save,
    decide,
    recheck,
)
from control.watchdog.observe import Observations
from control.watchdog.verdict import driver_dead
from ray_jobs.config import load_config
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.heartbeat import Beat
from tests.conftest import ROOT

NOW = 10_000.0
# Without a run host (HOSTED below: with one)
CFG = load_config(ROOT / "configs" / "demo.yaml", ["storage=/nonexistent/storage", "name=r",
    "fault_tolerance.stall_timeout_s=60", "fault_tolerance.confirm_s=30", "fault_tolerance.restart_backoff_s=10",
    "fault_tolerance.max_restarts=2", "fault_tolerance.run_host=false"])  # fmt: skip


def record(status: str = "RUNNING", state: str = "running", backend: str = "local", **fields: Any) -> RunRecord:
    attempt = Attempt(attempt=2, submission_id="unbroken-r-train-002", started_at=NOW - 500, started_by="watchdog",
                      resume_from="/s/ray/r/checkpoint-step-00000040", status=status)  # fmt: skip
    first = Attempt(attempt=1, submission_id="unbroken-r-train-001", started_at=NOW - 900, started_by="finetune-flow",
                    status="FAILED", ended_at=NOW - 510)  # fmt: skip
    base = {"name": "r", "created_at": NOW - 900, "state": state, "config": {}, "dataset_id": "ds-1", "restarts": 1,
            "cluster": ClusterRecord(address="http://h:8265", backend=backend, mode="local", started_here=True),
            "attempts": [first, attempt], "incidents": [restarted_at(1)]}  # fmt: skip
    return RunRecord(**(base | fields))


def restarted_at(attempt: int, **fields: Any) -> Incident:
    base = {"kind": "job-failed", "detected_by": "watchdog", "detected_at": NOW - 505, "attempt": attempt,
            "action": "restarted", "new_attempt": attempt + 1, "failed_step": 45, "progress_steps": 45,
            "last_progress_at": NOW - 520}  # fmt: skip
    return Incident(**(base | fields))


def beat(step: int = 80, last_step_ago_s: float = 2, phase: str = "training", **extra: Any) -> Beat:
    return Beat.model_validate({"run": "r", "attempt": 2, "max_steps": 100, "step": step, "time": NOW - 1,
                                "last_step_at": NOW - last_step_ago_s, "phase": phase, "phase_started_at": NOW - 100,
                                "started_step": 40} | extra)  # fmt: skip


def nodes(alive: int, dead: int = 0) -> Health:
    ns = [Node(f"n{i}", f"10.0.0.{i}", True, i == 0) for i in range(alive)]
    return Health(ns + [Node(f"d{i}", f"10.0.1.{i}", False, False) for i in range(dead)])


def open_incident(**fields: Any) -> Incident:
    base = {"kind": "job-failed", "detected_by": "finetune-flow", "detected_at": NOW - 3, "attempt": 2,
            "failed_step": 80, "progress_steps": 40, "last_progress_at": NOW - 5}  # fmt: skip
    return Incident(**(base | fields))


@dataclass
class Row:
    name: str
    reg: RunRecord
    obs: Observations
    outcome: str
    actions: list[type]
    check: dict[str, Any] = field(default_factory=dict)  # attribute path on the decided record -> value


def ok(view: JobView, b: dict | None = None, **obs: Any) -> Observations:
    return Observations(NOW, view, b, **obs)


FAILED = JobView("ok", "FAILED", "Job entrypoint command failed with exit code 1")
RUNNING = JobView("ok", "RUNNING")
CRASH = {"type": "RuntimeError", "message": "NCCL communicator aborted", "kinds": ["RuntimeError"]}
ROWS = [
    Row("healthy run: nothing to write", record(), ok(JobView("ok", "RUNNING"), beat()), "ok", []),
    Row(
        "first look at RUNNING: the attempt and the run become running",
        record("SUBMITTED", "submitted"),
        ok(JobView("ok", "RUNNING"), beat()),
        "ok",
        [Save],
        {"state": "running", "current.status": "RUNNING"},
    ),
    Row(
        "after a restart, its first step completes the incident's cost",
        record(),
        ok(JobView("ok", "RUNNING"), beat(first_step_at=NOW - 50)),
        "ok",
        [Save],
        {"incidents[0].first_new_step_at": NOW - 50, "incidents[0].time_to_recover_s": 455.0},
    ),
    Row(
        "the cluster does not know a job it was just given (still submitting)",
        record(
            "SUBMITTED",
            "submitted",
            attempts=[Attempt(attempt=1, submission_id="s", started_at=NOW - 5, started_by="finetune-flow")],
            incidents=[],
        ),
        ok(JobView("missing", why="no such job")),
        "ok",
        [],
    ),
    Row(
        "a long export is no stall",
        record(),
        ok(JobView("ok", "RUNNING"), beat(last_step_ago_s=400, phase="exporting")),
        "ok",
        [],
    ),
    # chaos: Jobs API 502s and resets; the dashboard SIGSTOPped -- seen, not acted on before confirm_s
    Row(
        "Jobs API 502: suspect",
        record(),
        ok(JobView("unknown", why="HTTP 502 from the Jobs API")),
        "observing",
        [Save],
        {"suspect.kind": "cluster-unreachable", "suspect.observations": 1, "state": "running"},
    ),
    Row(
        "dashboard SIGSTOP: a read time-out is suspect too",
        record(),
        ok(JobView("unknown", why="ReadTimeout")),
        "observing",
        [Save],
        {"suspect.first_at": NOW},
    ),
    Row(
        "a blip that healed is logged as observed",
        record(suspect=Suspect(kind="cluster-unreachable", attempt=2, first_at=NOW - 20, observations=3)),
        ok(JobView("ok", "RUNNING"), beat()),
        "ok",
        [Save],
        {"suspect": None, "incidents[-1].action": "observed", "incidents[-1].held_s": 20.0},
    ),
    # chaos: every process of the head killed -- no answer that held for confirm_s over 2+ looks: restart
    Row(
        "head killed: unreachable, confirmed",
        record(suspect=Suspect(kind="cluster-unreachable", attempt=2, first_at=NOW - 31, observations=1)),
        ok(JobView("unknown", why="ConnectionError"), metrics_step=70),
        "restarting",
        [Save, Log, Restart],
        {
            "state": "recovering",
            "incidents[-1].detected_at": NOW - 31,
            "incidents[-1].confirmed_at": NOW,
            "current.status": "LOST",
        },
    ),
    Row(
        "the cluster forgot the job: lost, confirmed",
        record(suspect=Suspect(kind="job-lost", attempt=2, first_at=NOW - 40, observations=2)),
        ok(JobView("missing", why="no such job")),
        "restarting",
        [Save, Log, Restart],
        {"incidents[-1].kind": "job-lost"},
    ),
    # chaos: kill -9 the job driver; kill -9 during a checkpoint write -- the API says FAILED: act at once
    Row(
        "driver killed: job failed, acted on at once (the restart waits out its backoff)",
        record(),
        ok(FAILED, beat(step=83), metrics_step=80),
        "waiting",
        [Save, Log],
        {
            "state": "recovering",
            "current.status": "FAILED",
            "incidents[-1].failed_step": 83,
            "incidents[-1].progress_steps": 43,
            "incidents[-1].next_restart_at": NOW + 20,
        },
    ),
    # chaos: SIGSTOP a train worker -- no step for longer than stall_timeout_s
    Row(
        "hung worker: stalled",
        record(),
        ok(JobView("ok", "RUNNING"), beat(last_step_ago_s=61)),
        "waiting",
        [Save, Log],
        {"current.status": "STALLED", "incidents[-1].kind": "stalled"},
    ),
    # chaos: kill a train worker / a worker host -- Ray Train recovers inside the job; health names a lost node
    Row(
        "a worker host died: noted, never a restart",
        record(shape={"attempt": 2, "nodes": 3}),
        ok(JobView("ok", "RUNNING"), beat(), health=nodes(2, dead=1)),
        "ok",
        [Log, ReplaceNodes, Save],
        {"incidents[-1].action": "noted", "incidents[-1].kind": "nodes-missing", "state": "running"},
    ),
    Row(
        "the lost node is back: the finding is cleared",
        record(
            shape={"attempt": 2, "nodes": 3},
            incidents=[
                restarted_at(1),
                Incident(
                    kind="nodes-missing",
                    detected_by="watchdog (cluster health)",
                    detected_at=NOW - 9,
                    attempt=2,
                    action="noted",
                    detail="nodes-missing: 2 of 3 nodes alive",
                ),
            ],
        ),
        ok(JobView("ok", "RUNNING"), beat(), health=nodes(3)),
        "ok",
        [Save],
        {"incidents[-1].cleared_at": NOW},
    ),
    # the job succeeded
    Row(
        "succeeded, started by the flow: closed; the flow releases",
        record(
            attempts=[
                Attempt(attempt=1, submission_id="s", started_at=NOW - 50, started_by="finetune-flow", status="RUNNING")
            ],
            incidents=[],
        ),
        ok(JobView("ok", "SUCCEEDED"), beat(), final_model="/nonexistent/storage/runs/r/final"),
        "succeeded",
        [Save],
        {"state": "succeeded", "current.status": "SUCCEEDED", "final_model": "/nonexistent/storage/runs/r/final"},
    ),
    Row(
        "succeeded after a watchdog restart: release the cluster, score it in its series, then the record",
        record(),
        ok(JobView("ok", "SUCCEEDED"), beat()),
        "succeeded",
        [CloseRun, Save],
        {"state": "succeeded", "final_model": None},
    ),
    # an open incident (the flow handed the run over, or a backoff is being waited out)
    Row(
        "handed over by the flow, backoff not over: wait",
        record(incidents=[restarted_at(1), open_incident()]),
        Observations(NOW),
        "waiting",
        [Save],
        {"incidents[-1].action": "waiting", "incidents[-1].next_restart_at": NOW - 3 + 20},
    ),
    Row(
        "handed over, backoff over: restart",
        record(incidents=[restarted_at(1), open_incident(detected_at=NOW - 30)]),
        Observations(NOW),
        "restarting",
        [Save, Restart],
    ),
    # give up
    Row(
        "a user error is not restarted",
        record(
            incidents=[
                open_incident(error={"type": "KeyError", "message": "'text'", "kinds": ["KeyError", "LookupError"]})
            ]
        ),
        Observations(NOW),
        "gave-up",
        [GiveUp, Log, ReleaseCluster],
        {"state": "failed", "incidents[-1].action": "gave-up"},
    ),
    Row(
        "the same job error at the same step twice is deterministic",
        record(incidents=[restarted_at(1, failed_step=80, error=CRASH), open_incident(error=CRASH)]),
        Observations(NOW),
        "gave-up",
        [GiveUp, Log, ReleaseCluster],
        {
            "reason": "deterministic failure: 2 attempts in a row failed at step 80 (job-failed: RuntimeError); a "
            "restart would fail the same way"
        },
    ),
    Row(
        "the same step twice with no root cause (a head reclaimed twice while loading) is the platform's: restarted",
        record(incidents=[restarted_at(1, failed_step=80), open_incident(detected_at=NOW - 30)]),
        Observations(NOW),
        "restarting",
        [Save, Restart],
    ),
    Row(
        "the restart budget is spent",
        record(
            restarts=2, incidents=[restarted_at(1, failed_step=10), restarted_at(1, failed_step=20), open_incident()]
        ),
        Observations(NOW),
        "gave-up",
        [GiveUp, Log, ReleaseCluster],
    ),
    Row(
        "a preemption never spends the budget",
        record(
            restarts=2,
            incidents=[
                restarted_at(1, failed_step=10),
                restarted_at(1, failed_step=20),
                open_incident(detected_at=NOW - 60, error={"type": "Preempted", "preempted": True}),
            ],
        ),
        Observations(NOW),
        "restarting",
        [Save, Restart],
    ),
    # -- two channels: the Jobs API and the heartbeat on storage (neither alone proves a job gone) ----------------
    Row(
        "the Jobs API silent while the heartbeat is fresh (a dead port-forward): observed, nothing stopped",
        record(),
        ok(JobView("unknown", why="ConnectionError: refused"), beat(), beat_age_s=1.0),
        "ok",
        [Log, Save],
        {
            "incidents[1].kind": "api-unreachable",
            "incidents[1].action": "observed",
            "incidents[1].cleared_at": None,
            "suspect": None,
            "state": "running",
        },
    ),
    Row(
        "still silent, still fresh: the same observed incident counts the look, no new one",
        record(
            incidents=[
                restarted_at(1),
                Incident(
                    kind="api-unreachable",
                    detected_by="watchdog",
                    detected_at=NOW - 60,
                    attempt=2,
                    action="observed",
                    observations=3,
                ),
            ]
        ),
        ok(JobView("unknown", why="ConnectionError: refused"), beat(), beat_age_s=1.0),
        "ok",
        [Save],
        {"incidents[1].observations": 4, "incidents[1].last_seen_at": NOW},
    ),
    Row(
        "the Jobs API answers again: the observed incident is cleared",
        record(
            incidents=[
                restarted_at(1),
                Incident(
                    kind="api-unreachable", detected_by="watchdog", detected_at=NOW - 60, attempt=2, action="observed"
                ),
            ]
        ),
        ok(JobView("ok", "RUNNING"), beat()),
        "ok",
        [Log, Save],
        {"incidents[1].cleared_at": NOW, "incidents[1].held_s": 60.0},
    ),
    Row(
        "live recovery replaced a replica inside the job: an observed incident, nothing stopped or restarted",
        record(),
        ok(JobView("ok", "RUNNING"), beat(heals=1, last_heal={"rank": 1, "step": 71, "heal_s": 0.31, "at": NOW - 2})),
        "ok",
        [Log, Save],
        {
            "incidents[1].kind": "replica-replaced",
            "incidents[1].action": "observed",
            "incidents[1].failed_step": 71,
            "incidents[1].held_s": 0.31,
            "state": "running",
        },  # fmt: skip
    ),
    Row(
        "the same heal seen again: no second incident, nothing written",
        record(
            incidents=[
                restarted_at(1),
                Incident(
                    kind="replica-replaced",
                    detected_by="live recovery (in job)",
                    detected_at=NOW - 2,
                    attempt=2,
                    action="observed",
                ),
            ]
        ),  # fmt: skip
        ok(JobView("ok", "RUNNING"), beat(heals=1, last_heal={"rank": 1, "step": 71, "heal_s": 0.31, "at": NOW - 2})),
        "ok",
        [],
    ),
    Row(
        "the Jobs API silent and the heartbeat old: suspected, not acted on at the first look",
        record(),
        ok(JobView("unknown", why="ConnectionError: refused"), beat(), beat_age_s=40.0),
        "observing",
        [Save],
        {"suspect.kind": "cluster-unreachable", "suspect.beat_time": NOW - 1},
    ),
    Row(
        "the Jobs API silent, the heartbeat old, and the backend sees no process of the job (a local head's host): "
        "two channels agree, acted on at the first look (the restart waits out its backoff)",
        record(),
        ok(JobView("unknown", why="ConnectionError: refused"), beat(), beat_age_s=40.0, job_gone=True, metrics_step=70),
        "waiting",
        [Save, Log],
        {"incidents[-1].kind": "cluster-unreachable", "incidents[-1].detected_at": NOW, "state": "recovering"},
    ),
    Row(
        "the backend sees no process of a job never seen running yet (its driver may not have started): suspected",
        record("SUBMITTED", "submitted"),
        ok(JobView("unknown", why="ConnectionError: refused"), job_gone=True),
        "observing",
        [Save],
        {"suspect.kind": "cluster-unreachable", "state": "submitted"},
    ),
    Row(
        "the backend sees no process of the job but its heartbeat is fresh: the fresh heartbeat still vetoes",
        record(),
        ok(JobView("unknown", why="ConnectionError: refused"), beat(), beat_age_s=1.0, job_gone=True),
        "ok",
        [Log, Save],
        {"incidents[1].kind": "api-unreachable", "incidents[1].action": "observed", "state": "running"},
    ),
    Row(
        "the cluster forgot the job and the backend sees none of its processes: lost, acted on at once",
        record(),
        ok(JobView("missing", why="no such job"), job_gone=True, metrics_step=70),
        "waiting",
        [Save, Log],
        {"incidents[-1].kind": "job-lost"},
    ),
    Row(
        "a suspicion whose heartbeat moved meanwhile is not confirmed: it starts over (the job lives)",
        record(
            suspect=Suspect(
                kind="cluster-unreachable", attempt=2, first_at=NOW - 100, observations=5, beat_time=NOW - 90
            )
        ),
        ok(JobView("unknown", why="ConnectionError: refused"), beat(), beat_age_s=40.0),
        "observing",
        [Save],
        {"suspect.first_at": NOW, "suspect.observations": 1},
    ),
    Row(
        "a heartbeat gone silent past the stall limit: confirmed first (storage may have been away for everyone)",
        record(),
        ok(JobView("ok", "RUNNING"), beat(last_step_ago_s=90), beat_age_s=70.0),
        "observing",
        [Save],
        {"suspect.kind": "stalled"},
    ),
    Row(
        "training quiet past the limit on the job's own clock, the heartbeat fresh: a hang, acted on at once",
        record(),
        ok(JobView("ok", "RUNNING"), beat(last_step_ago_s=65), beat_age_s=0.5),
        "waiting",
        [Save, Log],
        {"incidents[1].kind": "stalled"},
    ),
    Row(
        "the cluster's clock ten minutes ahead changes nothing: staleness is the file's age by the storage's clock",
        record(),
        ok(JobView("ok", "RUNNING"), beat(last_step_ago_s=-598, time=NOW + 600), beat_age_s=1.0),
        "ok",
        [],
    ),
    # -- restarts that cannot complete end ------------------------------------------------------------------------
    Row(
        "a restart that could not complete is backed off like a restart",
        record(incidents=[open_incident(action="waiting", failed_tries=1, last_try_at=NOW - 5)]),
        Observations(NOW),
        "waiting",
        [Save],
    ),
    Row(
        "restarts that could not complete spend the budget: a cluster gone for good ends in a give-up",
        record(
            incidents=[
                restarted_at(1),
                open_incident(
                    action="waiting",
                    failed_tries=1,
                    last_try_at=NOW - 60,
                    last_try_error="StopUnverified: the Ray cluster at http://h:8265 does not answer",
                ),
            ]
        ),  # fmt: skip
        Observations(NOW),
        "gave-up",
        [GiveUp, Log, ReleaseCluster],
        {"state": "failed", "incidents[1].action": "gave-up"},
    ),
    # -- every finished run fully closed ----------------------------------------------------------------------------
    Row(
        "a flow's attempt succeeded: recorded, its closing left to the flow for a while",
        record(
            attempts=[
                Attempt(attempt=1, submission_id="s", started_at=NOW - 90, started_by="finetune-flow", status="RUNNING")
            ],
            incidents=[],
        ),
        ok(JobView("ok", "SUCCEEDED"), beat(attempt=1)),
        "succeeded",
        [Save],
        {"state": "succeeded", "closing_since": NOW},
    ),
    Row(
        "a succeeded run its flow did not close (closing raised, or it was killed): the watchdog closes it",
        record(
            state="succeeded",
            closing_since=NOW - 130,
            attempts=[
                Attempt(
                    attempt=1, submission_id="s", started_at=NOW - 900, started_by="finetune-flow", status="SUCCEEDED"
                )
            ],
            incidents=[],
        ),  # fmt: skip
        Observations(NOW),
        "closed",
        [CloseRun, Save],
        {"closing_since": None},
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_decide(row: Row) -> None:
    before = row.reg.model_dump()
    decision = decide(row.reg, row.obs, CFG)
    assert decision.outcome.action == row.outcome, decision.outcome.detail
    assert [type(a) for a in decision.actions] == row.actions
    for path, want in row.check.items():
        assert _get(decision.record, path) == want, path
    assert row.reg.model_dump() == before, "decide changed the record it was given"


def _get(obj: Any, path: str) -> Any:
    for part in path.replace("]", "").replace("[", ".").split("."):
        obj = obj[int(part)] if part.lstrip("-").isdigit() else getattr(obj, part)
    return obj


def test_a_healthy_pass_writes_nothing_and_a_changed_one_writes_once(tmp_path: Path) -> None:
    quiet = decide(record(), ok(JobView("ok", "RUNNING"), beat()), CFG)
    assert Save not in map(type, quiet.actions)
    first = decide(record("SUBMITTED", "submitted"), ok(JobView("ok", "RUNNING"), beat()), CFG)
    assert [type(a) for a in first.actions].count(Save) == 1


def test_an_ambiguous_sign_needs_two_looks_and_confirm_s(tmp_path: Path) -> None:
    reg, blip = record(), JobView("unknown", why="HTTP 502")
    for t, want in ((0, "observing"), (10, "observing"), (29, "observing"), (31, "restarting")):
        decision = decide(reg, Observations(NOW + t, blip), CFG)
        assert decision.outcome.action == want, t
        reg = decision.record
    assert reg.incidents[-1].observations == 4 and reg.incidents[-1].detected_at == NOW


# -- the flow's watch: the same confirmation rule, 5 polls (control/jobs.py judge) --------------------------------
@pytest.mark.parametrize(
    ("polls", "lost_at"),
    [
        ([("unknown", 0), ("unknown", 10), ("ok", 20)], None),  # a blip that healed
        ([("unknown", t) for t in (0, 10, 20, 31)], None),  # held 31 s but only 4 polls
        ([("unknown", t) for t in (0, 10, 20, 25, 31)], 4),  # 5 polls over 31 s: lost
        ([("missing", t) for t in (0, 1, 2, 3, 4, 30)], 5),  # a job the cluster forgot, confirmed the same way
        ([("unknown", 0), ("unknown", 29), ("ok", 30), ("unknown", 31), ("unknown", 40)], None),  # a new window
    ],
)
def test_the_flows_watch_takes_a_cluster_for_lost_only_once_its_silence_held(polls, lost_at) -> None:
    from control.jobs import judge

    suspicion, lost = None, None
    for i, (api, t) in enumerate(polls):
        j = judge(JobView(api, "RUNNING" if api == "ok" else "", why="502"), suspicion, 30.0, NOW + t)
        suspicion = j.suspicion
        if j.lost and lost is None:
            lost = i
    assert lost == lost_at


RECHECKS = [  # a restart decided, and the look taken right before it: (name, view, heartbeat, outcome, actions, check)
    ("still failed: resubmit", FAILED, None, "restarting", [Resubmit], {"incidents[-1].action": None}),
    ("running again, fresh heartbeat: stood down, adopted", JobView("ok", "RUNNING"), beat(), "ok", [Save, Log],
     {"incidents[-1].action": "observed", "state": "running", "current.adopted_by": "watchdog"}),
    ("found succeeded: stood down and finished", JobView("ok", "SUCCEEDED"), beat(phase="done"), "succeeded",
     [Save, Log, CloseRun, Save], {"incidents[-1].action": "observed", "state": "succeeded"}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "view", "b", "outcome", "actions", "check"), RECHECKS, ids=[r[0] for r in RECHECKS])
def test_a_restart_is_decided_again_on_a_look_taken_right_before_it(name, view, b, outcome, actions, check) -> None:
    reg = record("FAILED", "recovering", incidents=[restarted_at(1), open_incident()])
    before = reg.model_dump()
    decision = recheck(reg, ok(view, b), CFG)
    assert decision.outcome.action == outcome, decision.outcome.detail
    assert [type(a) for a in decision.actions] == actions
    for path, want in check.items():
        assert _get(decision.record, path) == want, path
    assert reg.model_dump() == before, "recheck changed the record it was given"


# -- a run host (fault_tolerance.run_host): the job's driver lost while what trains lives on -----------------------
HOSTED = CFG.model_copy(update={"fault_tolerance": CFG.fault_tolerance.model_copy(update={"run_host": True})})
HOST_ROWS = [  # (name, observations, config, outcome, actions)
    ("driver killed, its host trains on (FAILED without a word, a fresh heartbeat): a driver re-attaches, nothing "
     "is counted", ok(FAILED, beat(step=83)), HOSTED, "reattached", [Reattach]),
    ("the driver relayed a root cause: the training failed indeed", ok(FAILED, beat(), error=JobFailure(**CRASH)),
     HOSTED, "waiting", [Save, Log]),
    ("its heartbeat went stale: the host is gone with its driver", ok(FAILED, beat(), beat_age_s=60.0), HOSTED,
     "waiting", [Save, Log]),
    ("a stopped job (a cancel) is no lost driver", ok(JobView("ok", "STOPPED"), beat()), HOSTED, "waiting",
     [Save, Log]),
    ("without a run host the same look is a failed job", ok(FAILED, beat(step=83)), CFG, "waiting", [Save, Log]),
    ("a head restarted under GCS FT: RUNNING to its Jobs API, the node its driver ran on dead, the host trains on: "
     "a driver re-attaches", ok(RUNNING, beat(step=83), driver_dead=True), HOSTED, "reattached", [Reattach]),
    ("the same with the heartbeat gone stale: no host is known to train, the stall rules judge it",
     ok(RUNNING, beat(), driver_dead=True, beat_age_s=60.0), HOSTED, "waiting", [Save, Log]),
    ("the same without a run host: nothing outlived the driver to attach to, the stall rules judge it",
     ok(RUNNING, beat(), driver_dead=True), CFG, "ok", []),
]  # fmt: skip


def test_a_running_jobs_driver_is_dead_only_when_the_cluster_lists_its_node_dead() -> None:
    view = JobView("ok", "RUNNING", driver_node="d0")
    assert driver_dead(view, nodes(alive=2, dead=1))
    assert not driver_dead(JobView("ok", "RUNNING", driver_node="n1"), nodes(alive=2, dead=1)), "alive"
    assert not driver_dead(view, nodes(alive=2)), "not listed: unknown is not dead"
    assert not driver_dead(view, Health(None, "no answer")), "the summary unread"
    assert not driver_dead(JobView("ok", "RUNNING"), nodes(alive=2, dead=1)), "the Jobs API named no node"


@pytest.mark.parametrize(("name", "obs", "cfg", "outcome", "actions"), HOST_ROWS, ids=[r[0] for r in HOST_ROWS])
def test_a_driver_lost_while_its_run_host_trains_on_is_re_attached_not_restarted(name, obs, cfg, outcome, actions):
    decision = decide(record(), obs, cfg)
    assert decision.outcome.action == outcome, decision.outcome.detail
    assert [type(a) for a in decision.actions] == actions
    if outcome == "reattached":
        assert decision.record.state == "running" and decision.record.restarts == 1
        assert decision.record.open_incident() is None


def test_a_flows_hand_over_of_a_lost_driver_is_stood_down_and_re_attached_on_the_re_check() -> None:
    reg = record("FAILED", "recovering", incidents=[restarted_at(1), open_incident()])
    decision = recheck(reg, ok(FAILED, beat()), HOSTED)
    assert decision.outcome.action == "reattached", decision.outcome.detail
    assert [type(a) for a in decision.actions] == [Save, Log, Reattach]
    assert decision.record.incidents[-1].action == "observed" and decision.record.state == "submitted"
    assert decision.record.current.adopted_by == "watchdog"


def test_act_carries_out_and_decides_nothing() -> None:
    """act.py imports from decide only what a decision is made of (its action and outcome classes), and nothing of
    verdict: the restart's re-check is decide's (``recheck``), run by the pass."""
    import ast
    import importlib

    decide_module = importlib.import_module("control.watchdog.decide")  # the package's `decide` is the function

    tree = ast.parse((ROOT / "control" / "watchdog" / "act.py").read_text())
    taken = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    from_decide = [name for module, name in taken if module == "control.watchdog.decide"]
    assert from_decide and all(isinstance(getattr(decide_module, n), type) for n in from_decide), from_decide
    assert not [m for m, _ in taken if m == "control.watchdog.verdict"]
