"""``unbroken status``: a human summary of a run from storage alone -- state, attempts, incidents, heartbeat, final
model."""

from __future__ import annotations

import time

from control.records.run import Attempt, Incident, RunRecord
from control.registry import load, pick
from ray_jobs.contracts.base import RecordError
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.errors import RunNotFound
from ray_jobs.storage import Layout


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _took(a: Attempt) -> str:
    if not a.ended_at:
        return "running"
    s = int(a.ended_at - a.started_at)
    return f"{s // 60}m{s % 60:02d}s"


def describe(storage: str, run: str) -> str:
    """A human summary of a run from storage alone: state, attempts, incidents, heartbeat, final model."""
    reg = load(storage, run)
    if reg is None:
        raise RunNotFound(f"no run {run!r} under {storage} (looked for {Layout(storage).run_registry(run)})")
    if reg.search is not None:
        return _trial(storage, reg)
    mode, address = (reg.cluster.mode or "-", reg.cluster.address) if reg.cluster else ("-", "")
    lines = [f"run {run}: {reg.state}", f"  dataset: {reg.dataset_id or '-'}    cluster: {mode} {address}", "attempts:"]
    if reg.kind == "search":
        lines.insert(1, f"  search of {len(reg.trials)} trials: {', '.join(reg.trials)}")
    for a in reg.attempts:
        msg = f"  {a.message.splitlines()[0][:100]}" if a.message else ""
        lines.append(f"  #{a.attempt} {a.submission_id}  {a.status:<9} {_when(a.started_at)}  {_took(a)}{msg}")
    lines.append(f"restarts: {reg.restarts} of {pick(reg.config, 'fault_tolerance.max_restarts')}")
    lines.append("incidents:" if reg.incidents else "incidents: none")
    lines += [_incident_line(i) for i in reg.incidents]
    if reg.state == "failed" and reg.reason:
        lines.append(f"reason: {reg.reason}")
    lines.append(_heartbeat_line(storage, run))
    if reg.final_model:
        lines.append(f"final model: {reg.final_model}")
    return "\n".join(lines)


def _trial(storage: str, reg: RunRecord) -> str:
    """A search's trial: its values, how it ended, its heartbeat; its jobs are the search's."""
    values = ", ".join(f"{k}={v}" for k, v in (reg.params or {}).items())
    lines = [
        f"run {reg.name}: {reg.state}",
        f"  trial of search {reg.search} (unbroken status {reg.search}: its jobs and incidents)",
        f"  values: {values or '-'}",
        f"  dataset: {reg.dataset_id or '-'}",
        _heartbeat_line(storage, reg.name),
    ]
    if reg.final_model:
        lines.append(f"final model: {reg.final_model}")
    return "\n".join(lines)


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def _incident_line(i: Incident) -> str:
    """One incident: what, who saw it, what was done, and what it cost."""
    head = f"  {_when(i.detected_at)} {i.kind} (attempt {i.attempt}, by {i.detected_by})"
    action = i.action or "open"
    if action == "restarted":
        what = (
            f"restarted as attempt {i.new_attempt} from "
            + (f"step {i.resumed_step}" if i.resumed_step is not None else "scratch")
            + f"; lost steps {'-' if i.lost_steps is None else i.lost_steps}; silent {_secs(i.silent_s)} before "
            f"detection; first new step {_secs(i.time_to_recover_s)} after detection"
        )
    elif action == "noted":  # a health finding: named, never a restart (a lost node may be asked back: repair)
        what = "noted" + (f", cleared {_when(i.cleared_at)}" if i.cleared_at else ", still holds")
        what += f"; {i.repair}" if i.repair else ""
    elif action == "observed":  # a sign that did not hold, or channels that disagreed: nothing was done
        looks = f" over {i.observations} looks" if i.observations else ""
        held = f"held {i.held_s:.0f}s{looks}" if i.held_s is not None else f"still holds ({i.observations or 1} looks)"
        what = f"observed, nothing done; {held}"
    elif i.failed_tries and i.open:
        what = f"{action}: {i.failed_tries} restart(s) could not complete, the last: {i.last_try_error}"
    else:
        what = action + (f": {i.reason}" if i.reason else "")
    detail = f"\n    {i.detail}" if i.detail else ""
    return f"{head}: {what}{detail}"


def _heartbeat_line(storage: str, run: str) -> str:
    try:
        beat = Beat.read(Layout(storage).heartbeat(run))
    except RecordError as e:  # torn, hand-edited or a newer release's: said, and the rest of the status still shown
        return f"heartbeat: unreadable ({e})"
    if beat is None:
        return "heartbeat: none yet"
    age = time.time() - beat.last_step_at
    return f"heartbeat: step {beat.step}/{beat.max_steps}, last step {age:.0f}s ago, {beat.tokens_per_s} tokens/s"
