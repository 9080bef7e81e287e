"""A run's life: its states and the moves between them, as one table, and the one function that changes a run
record's ``state``. The finetune flow's tasks (through ``control/registry.py``), the watchdog's decisions and
restart, and a search's trial records all move a run through :func:`move`; none writes ``state`` itself, and a move
the table does not allow is an error (:class:`IllegalMove`), never a silent overwrite.

Like Ray Train v2's controller states, each state says what may come next; like Kubernetes' conditions, the record
keeps why (``reason``, the attempts' statuses, the incidents) beside the state, which is the summary:

- ``submitted``: an attempt's job was submitted (a new attempt may begin from any state: whether one may is the
  registry's call -- ``RunBusy`` while an attempt is in flight -- not the table's);
- ``running``: Ray says the current attempt's job runs;
- ``recovering``: an open incident (the watchdog restarts the run, or waits out a backoff);
- ``succeeded``, ``failed``: over (``failed``: given up, cancelled, or failed before training could start);
- ``stopped-early``: a search's trial its scheduler stopped (a verdict on its values, not a failure).

A trial's record follows its search's trials.json (Tune owns the trial: a restored search restarts a failed trial),
so a trial has its own row set (:data:`TRIAL_MOVES`). The writes that persist a move hold the run's lease
(``control/registry.py``; the watchdog acts under its own); a move itself is pure, so a decision stays a pure
function of the record it is given.
"""

from __future__ import annotations

from control.records.run import RunRecord, State

# state -> the states a run may move to from it (besides ``submitted``, a new attempt, and staying where it is)
MOVES: dict[State, tuple[State, ...]] = {
    "submitted": ("running", "recovering", "succeeded", "failed"),
    "running": ("recovering", "succeeded", "failed"),
    # restarted (submitted), healthy again when re-checked (running), given up, or its job succeeded after all
    "recovering": ("running", "succeeded", "failed"),
    "succeeded": (),
    "failed": (),
    "stopped-early": (),
}
# A search's trial: its state follows trials.json (pending -> running -> completed / stopped-early / failed), and
# a restored search runs a failed trial again
TRIAL_MOVES: dict[State, tuple[State, ...]] = {
    "submitted": ("running", "succeeded", "stopped-early", "failed"),
    "running": ("succeeded", "stopped-early", "failed"),
    "succeeded": (),
    "stopped-early": (),
    "failed": ("running", "succeeded", "stopped-early"),
    "recovering": (),
}


class IllegalMove(RuntimeError):
    """A state change the table does not allow: a bug in whoever asked for it (the record is left as it was)."""


def allowed(reg: RunRecord, to: State) -> bool:
    """Whether ``reg`` may move to ``to``: a new attempt (``submitted``) always may, as may staying where it is."""
    table = TRIAL_MOVES if reg.search is not None else MOVES
    return to in (reg.state, "submitted") or to in table[reg.state]


def move(reg: RunRecord, to: State) -> bool:
    """Move ``reg`` to state ``to``; True when the state changed. IllegalMove when the table does not allow it (the
    why -- ``reason``, the attempt's status, the incident -- is the caller's to record beside it)."""
    if not allowed(reg, to):
        raise IllegalMove(f"run {reg.name}: {reg.state} -> {to} is not a move of a run's life (control/lifecycle.py)")
    changed = reg.state != to
    reg.state = to
    return changed


def mark_running(reg: RunRecord, attempt: int) -> bool:
    """The current attempt ``attempt`` was SUBMITTED and now runs (the run, if just submitted, is ``running``).
    False when that is not news."""
    if len(reg.attempts) != attempt or reg.current.status != "SUBMITTED":
        return False
    reg.current.status = "RUNNING"
    if reg.state == "submitted":
        move(reg, "running")
    return True
