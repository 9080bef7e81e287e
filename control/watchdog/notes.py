"""What a look at a healthy run notes in its record (control/watchdog/decide.py's ``healthy`` and ``finish``): the
Jobs API silent while the heartbeat is fresh, replicas that live recovery replaced inside the job, the time the last
restart took to recover, the cluster's health while its job runs. Each an incident observed or noted, never a
restart. Pure: changes only the record it is given; each returns whether it changed it (and the actions to take)."""

from __future__ import annotations

from typing import Any

from control.backends.health import assess
from control.rayapi import first_line
from control.records.run import Incident, RunRecord, Shape
from control.watchdog.decision import Log, ReplaceNodes
from control.watchdog.observe import Observations
from control.watchdog.verdict import Verdict
from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat


def note_api(reg: RunRecord, verdict: Verdict, now: float) -> tuple[bool, list[Any]]:
    """Keep the ``api-unreachable`` incident of the current attempt up to date: opened (and logged) when the API
    first fails while the heartbeat is fresh, its looks counted while it lasts, cleared once the API answers again.
    Returns (record changed, actions)."""
    attempt = reg.current.attempt
    ongoing = next(
        (i for i in reg.incidents if i.kind == "api-unreachable" and i.cleared_at is None and i.attempt == attempt),
        None,
    )
    if verdict.kind != "api-unreachable":
        if ongoing is None:
            return False, []
        ongoing.set(cleared_at=now, held_s=round(now - ongoing.detected_at, 3))
        return True, [Log("info", f"run {reg.name}: the Jobs API answers again after {now - ongoing.detected_at:.0f}s")]
    if ongoing is not None:
        ongoing.set(observations=(ongoing.observations or 0) + 1, last_seen_at=now)
        return True, []
    reg.incidents.append(
        Incident(
            kind="api-unreachable",
            detected_by="watchdog",
            detected_at=now,
            attempt=attempt,
            action="observed",
            observations=1,
            last_seen_at=now,
            detail=first_line(verdict.detail),
        )
    )
    message = f"run {reg.name}: {verdict.detail} -- observed, nothing stopped or restarted while it trains"
    return True, [Log("warning", message)]


def note_heals(reg: RunRecord, beat: Beat | None) -> tuple[bool, list[Any]]:
    """Live recovery replaced a lost replica inside the job (its heartbeat counts this attempt's heals): one
    ``replica-replaced`` incident each, observed -- training never stopped, nothing is for the watchdog to do."""
    attempt = reg.current.attempt
    if not beat or beat.attempt != attempt or not beat.heals:
        return False, []
    seen = sum(1 for i in reg.incidents if i.kind == "replica-replaced" and i.attempt == attempt)
    heal = beat.last_heal  # (every writer sets it with heals; a heartbeat without it still counts, unnamed)
    rank, step, heal_s, lost, at = (
        (heal.rank, heal.step, heal.heal_s, heal.lost_steps, heal.at) if heal else (None, None, None, 0, beat.time)
    )
    detail = (
        f"replica {rank} replaced at step {step}: healed from a live peer in {heal_s}s, {lost} steps lost, "
        "training never stopped"
    )
    for _ in range(beat.heals - seen):  # a pass sees the last heal; earlier ones since the last pass, counted
        reg.incidents.append(
            Incident(
                kind="replica-replaced",
                detected_by="live recovery (in job)",
                detected_at=at,
                attempt=attempt,
                action="observed",
                failed_step=step,
                held_s=heal_s,
                detail=detail,
            )
        )
    if beat.heals <= seen:
        return False, []
    return True, [Log("info", f"run {reg.name}: {detail}")]


def note_progress(reg: RunRecord, beat: Beat | None) -> bool:
    """Complete the last restart's incident once its attempt has trained a step: the time to recover.
    True when the record changed."""
    if not beat or not beat.first_step_at:
        return False
    for inc in reversed(reg.incidents):
        if inc.action == "restarted" and inc.new_attempt == beat.attempt:
            if inc.first_new_step_at is not None:
                return False
            first, since = beat.first_step_at, inc.last_progress_at
            inc.set(first_new_step_at=first, time_to_recover_s=round(first - inc.detected_at, 3))
            if since is not None:  # (an incident recorded by an older release may lack it: no downtime, no crash)
                inc.downtime_s = round(first - since, 3)
            return True
    return False


def note_health(reg: RunRecord, cfg: Config, obs: Observations) -> tuple[bool, list[str], list[Any]]:
    """The cluster's health while its job runs (control/backends/health.py): each new finding becomes an incident
    of its kind with action ``noted`` (named, logged, never a restart: the job still runs, and Ray Train or the next
    failure decides), a lost node is asked back of a backend that can; a finding that no longer holds is marked
    cleared. Nodes expected: the most the current attempt's cluster had alive at any look. A summary that cannot
    be read concludes nothing. Returns (record changed, the findings' keys, actions)."""
    h = obs.health
    if h is None or h.nodes is None:
        return False, [], []
    attempt = reg.current.attempt
    before = reg.shape.model_copy() if reg.shape else None
    if reg.shape is None or reg.shape.attempt != attempt:
        reg.shape = Shape(attempt=attempt, nodes=0)
    changed = reg.shape != before or len(h.alive) > reg.shape.nodes
    reg.shape.nodes = max(reg.shape.nodes, len(h.alive))
    findings = assess(h, cfg, reg.shape.nodes, obs.disk)
    keys = [f.key() for f in findings]
    noted = {i.detail: i for i in reg.incidents if i.action == "noted" and i.cleared_at is None}
    actions: list[Any] = []
    for f in (f for f in findings if f.key() not in noted):
        actions.append(Log("warning", f"run {reg.name}: cluster health: {f.key()}"))
        reg.incidents.append(
            Incident(
                kind=f.kind,
                detected_by="watchdog (cluster health)",
                detected_at=obs.now,
                attempt=attempt,
                action="noted",
                detail=f.key(),
            )
        )
        actions += [ReplaceNodes(f.key())] if f.kind == "nodes-missing" else []
        changed = True
    for key, inc in noted.items():
        if key not in keys:
            inc.cleared_at, changed = obs.now, True
    return changed, keys, actions
