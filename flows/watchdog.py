"""The watchdog flow: one pass over every active run under a storage root; restarts what failed, hung or lost its
cluster (the rules: control/watchdog/, observe -> decide -> act). Independent of the finetune flow: it needs only the
storage.

Each pass is one flow run (a scheduled deployment runs it on an interval; ``unbroken watchdog`` loops it).
Recoveries and give-ups are Prefect events (``unbroken.run.recovered`` / ``unbroken.run.gave-up``, resource
``unbroken.run.<run>``), for automations and for people watching the event feed.
"""

from __future__ import annotations

import time
from typing import TypedDict

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from pydantic import JsonValue

from control import registry
from control.logs import run_logger
from control.summaries import TableRow
from control.watchdog import Outcome, check_run, janitor, left_alone, metrics
from ray_jobs.config import absolute_url
from ray_jobs.secrets import mask_tree

EVENTS = {"restarted": "unbroken.run.recovered", "gave-up": "unbroken.run.gave-up"}


@task(name="check-run", cache_policy=NO_CACHE, task_run_name="check-{run}")
def check_run_task(storage: str, run: str) -> Outcome:
    return check_run(storage, run)


def emit(outcome: Outcome) -> None:
    """The event for a recovery or a give-up (nothing for a healthy run)."""
    name = EVENTS.get(outcome.action)
    if name is None:
        return
    incident = outcome.incident.dump() if outcome.incident is not None else {}
    emit_event(
        event=name,
        resource={"prefect.resource.id": f"unbroken.run.{outcome.run}", "prefect.resource.name": outcome.run},
        payload=mask_tree({"run": outcome.run, "detail": outcome.detail, "incident": incident}),
    )


def skip_unreadable(run: str, why: str) -> Outcome:
    """A run whose record this release cannot read (a newer release's, hand-edited, torn): named -- which file, which
    field or version -- counted, and left alone; the pass goes on with the others."""
    return left_alone(Outcome(run, "unreadable", f"skipped: {why}"), "error")


class OutcomeDict(TypedDict):
    """An outcome as plain JSON: what the watchdog flow returns, one per run."""

    run: str
    action: str
    detail: str
    incident: dict[str, JsonValue] | None


def as_json(outcome: Outcome) -> OutcomeDict:
    incident = outcome.incident.dump() if outcome.incident is not None else None
    return {"run": outcome.run, "action": outcome.action, "detail": outcome.detail, "incident": incident}


def incidents_table(storage: str, runs: list[str]) -> list[TableRow]:
    rows: list[TableRow] = []
    for run in runs:
        reg = registry.load(storage, run)
        for i in reg.incidents if reg else []:
            rows.append(
                {
                    "run": run,
                    "detected": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.detected_at)),
                    "kind": i.kind,
                    "attempt": i.attempt,
                    "action": i.action or "open",
                    "resumed step": i.resumed_step,
                    "lost steps": i.lost_steps,
                    "silent (s)": i.silent_s,
                    "to first new step (s)": i.time_to_recover_s,
                    "detail": (i.reason or i.detail or "")[:200],
                }
            )
    return rows


@flow(name="watchdog", flow_run_name="watchdog")
def watchdog(storage: str = ".unbroken/storage") -> list[OutcomeDict]:
    """Check every active run under ``storage`` once; returns what was done for each."""
    log = run_logger()
    storage = absolute_url(storage)
    unreadable: list[tuple[str, str]] = []
    active = registry.active_runs(storage, unreadable)
    log.info("%d active run(s) under %s: %s", len(active), storage, ", ".join(active) or "-")
    outcomes = [as_json(skip_unreadable(run, why)) for run, why in unreadable]
    for run in active:
        try:
            outcome = check_run_task(storage, run)
        except Exception as e:  # one run's trouble (say, its cluster cannot be provisioned) must not starve others
            log.error("run %s: check failed: %s: %s", run, type(e).__name__, e)
            outcome = Outcome(run, "error", f"{type(e).__name__}: {e}")
        log.info("run %s: %s %s", run, outcome.action, outcome.detail)
        emit(outcome)
        outcomes.append(as_json(outcome))
    try:
        janitor(storage)  # clusters unbroken brought up on Kubernetes for runs that are over
    except Exception as e:  # never a reason to fail the pass: the next one tries again
        log.warning("janitor: %s: %s", type(e).__name__, e)
    metrics.passed(len(active))  # served by `unbroken watchdog --metrics-port`
    rows = incidents_table(storage, active)
    if rows:
        create_table_artifact(
            mask_tree(rows), key="watchdog-incidents", description=f"incidents of active runs under {storage}"
        )
    return outcomes
