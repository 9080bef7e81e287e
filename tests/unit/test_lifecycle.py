"""A run's life (control/lifecycle.py): the moves its table allows and refuses, for a run and a search's trial, and
that no product module writes a run record's ``state`` but that one."""

from __future__ import annotations

import ast

import pytest

from control import lifecycle
from control.records.run import STATES, Attempt, RunRecord
from tests.conftest import ROOT

RUN = [
    ("submitted", "running", True),
    ("submitted", "recovering", True),  # the watchdog saw it lost before it ran
    ("running", "succeeded", True),
    ("running", "failed", True),
    ("running", "recovering", True),
    ("recovering", "submitted", True),  # restarted
    ("recovering", "running", True),  # healthy again when re-checked before the restart
    ("recovering", "failed", True),  # given up
    ("succeeded", "submitted", True),  # the name run again: a new attempt
    ("failed", "submitted", True),
    ("succeeded", "succeeded", True),  # the flow's end of an attempt the watchdog already recorded succeeded
    ("succeeded", "failed", False),  # a finished run is never marked failed after its training
    ("succeeded", "running", False),
    ("failed", "running", False),
    ("failed", "recovering", False),  # no restart of a run given up, but by a new attempt
    ("submitted", "stopped-early", False),  # a verdict of a search's scheduler: a trial's alone
]
TRIAL = [
    ("submitted", "running", True),
    ("running", "stopped-early", True),
    ("running", "succeeded", True),
    ("failed", "running", True),  # a restored search runs its failed trial again
    ("succeeded", "running", False),
    ("stopped-early", "running", False),
    ("running", "recovering", False),  # the watchdog looks after the search, never a trial on its own
]


def record(state: str, search: str | None = None) -> RunRecord:
    return RunRecord(name="r", state=state, search=search)  # ty: ignore[invalid-argument-type]


@pytest.mark.parametrize(("now", "to", "ok"), RUN)
def test_a_runs_moves_are_its_tables(now: str, to: str, ok: bool) -> None:
    reg = record(now)
    if ok:
        lifecycle.move(reg, to)  # ty: ignore[invalid-argument-type]
        assert reg.state == to
    else:
        with pytest.raises(lifecycle.IllegalMove, match=f"{now} -> {to}"):
            lifecycle.move(reg, to)  # ty: ignore[invalid-argument-type]
        assert reg.state == now  # left as it was


@pytest.mark.parametrize(("now", "to", "ok"), TRIAL)
def test_a_trials_moves_follow_its_search(now: str, to: str, ok: bool) -> None:
    reg = record(now, search="s")
    assert lifecycle.allowed(reg, to) is ok  # ty: ignore[invalid-argument-type]


def test_every_state_has_its_row_in_both_tables_and_moves_only_to_states() -> None:
    for table in (lifecycle.MOVES, lifecycle.TRIAL_MOVES):
        assert set(table) == set(STATES)
        assert all(set(to) <= set(STATES) for to in table.values())


def test_a_submitted_attempt_that_runs_moves_the_run_once() -> None:
    reg = record("submitted")
    reg.attempts.append(Attempt(attempt=1, submission_id="s", started_at=0.0, started_by="finetune-flow"))
    assert lifecycle.mark_running(reg, 1) and reg.state == "running" and reg.current.status == "RUNNING"
    assert not lifecycle.mark_running(reg, 1)  # not news
    assert not lifecycle.mark_running(reg, 2)  # not the current attempt


def _writes_state(tree: ast.AST) -> list[int]:
    """Lines that assign an attribute ``state`` or pass ``state=`` to a call (``reg.set``, ``RunRecord(...)``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [t.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr == "state"]
        if isinstance(node, ast.Call) and any(k.arg == "state" for k in node.keywords):
            lines.append(node.lineno)
    return lines


# Writers of another record's ``state``: a series entry's (control/series/lineage.py) and a row of a search's trials
# table (control/series/search.py's view): not a run record's
OTHER_RECORDS = {"control/series/lineage.py": 1, "control/series/search.py": 1}


def test_only_the_lifecycle_module_writes_a_run_records_state() -> None:
    found = {}
    for folder in ("control", "tasks", "flows", "unbroken", "deployments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel != "control/lifecycle.py" and (lines := _writes_state(ast.parse(path.read_text()))):
                found[rel] = len(lines)
    assert found == OTHER_RECORDS
