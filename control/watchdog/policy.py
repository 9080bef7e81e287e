"""The restart policy, as rules over the run record: when a restart is pointless or not allowed (an error in the
code or data, a deterministic failure, the restart budget spent), and how long to wait before the next one. Pure."""

from __future__ import annotations

from control.records.run import Incident, RunRecord
from ray_jobs.config import Config

# Exceptions that say the code or the config is wrong: the same job would fail the same way again.
USER_ERRORS = frozenset(
    {
        "ConfigError",
        "ValidationError",
        "RunConflict",
        "CheckpointInvalid",
        "SyntaxError",
        "ImportError",
        "ModuleNotFoundError",
        "NameError",
        "AttributeError",
        "TypeError",
        "KeyError",
        "IndexError",
        "ValueError",
        "AssertionError",
        "NotImplementedError",
        "ZeroDivisionError",
        "UnicodeDecodeError",
        "OutOfMemoryError",
    }
)
# The storage failing (ray_jobs/checkpoint: StorageUnreachable; a full disk): never the job's own doing, however often.
STORAGE_ERRORS = frozenset({"StorageUnreachable", "StorageFull"})
# Two failures in a row at the same step with the same error: deterministic, not bad luck.
SAME_FAILURE_LIMIT = 2


def backoff_s(cfg: Config, restarts_done: int) -> float:
    """Wait before restart number ``restarts_done + 1``: base, 2x base, 4x base ... capped."""
    ft = cfg.fault_tolerance
    return min(ft.restart_backoff_s * 2**restarts_done, ft.restart_backoff_max_s)


def budget_used(reg: RunRecord, cfg: Config, current: Incident) -> int:
    """Restarts counted against their budget: for a preemption, the preemptions restarted since the last attempt that
    trained ``progress_resets_budget_steps`` new steps (``max_preemptions``); otherwise the other restarts since then
    (``max_restarts``). A restart tried that could not complete (its old job's end unverifiable, its cluster not
    provisioned) counts as one: a run whose cluster is gone for good ends, it is not retried forever."""
    window = cfg.fault_tolerance.progress_resets_budget_steps
    tries = current.failed_tries or 0
    if window and current.progress_steps >= window:
        return tries
    used = 0
    for inc in reg.incidents:
        if inc is current or inc.action != "restarted":
            continue
        if window and inc.progress_steps >= window:
            used = 0
        used += (inc.preempted == current.preempted) + (inc.failed_tries or 0)
    return used + tries


def give_up_reason(reg: RunRecord, cfg: Config, incident: Incident) -> str | None:
    """Why restarting again would be pointless or not allowed (naming the rule); None when a restart is in order. A
    preemption is the platform's doing, never the run's: only its own budget (``max_preemptions``) bounds it."""
    if incident.preempted:
        return _preemptions_spent(reg, cfg, incident)
    return _user_error(incident) or _deterministic(reg, incident) or _budget_spent(reg, cfg, incident)


def _user_error(incident: Incident) -> str | None:
    error = incident.error
    if error is not None and (error.user or USER_ERRORS.intersection(error.names())):
        return (
            f"the job raised {error.type}: {error.message} -- an error in the code, data or config, "
            "which a restart would repeat"
        )
    return None


def _deterministic(reg: RunRecord, incident: Incident) -> str | None:
    """The same job error (a root cause the job printed) at the same step, twice in a row. Trouble without a root
    cause -- a head reclaimed twice while loading, two waits for GPUs that stalled -- is the platform's, and only the
    budget bounds it."""
    error = incident.error
    if error is None or not error.type or STORAGE_ERRORS.intersection(error.names()):
        return None  # (the storage failing twice at one step is the storage's, not the job's)
    past = [i for i in reg.incidents if i is not incident and i.action == "restarted"]
    same = [i for i in past[-(SAME_FAILURE_LIMIT - 1) :] if _same_failure(i, incident)]
    if incident.failed_step is not None and len(same) == SAME_FAILURE_LIMIT - 1:
        return (
            f"deterministic failure: {SAME_FAILURE_LIMIT} attempts in a row failed at step {incident.failed_step} "
            f"({incident.kind}: {error.type}); a restart would fail the same way"
        )
    return None


def _budget_spent(reg: RunRecord, cfg: Config, incident: Incident) -> str | None:
    used, budget = budget_used(reg, cfg, incident), cfg.fault_tolerance.max_restarts
    if used < budget:
        return None
    window = cfg.fault_tolerance.progress_resets_budget_steps
    since = f" since the last attempt that trained {window}+ steps" if window else ""
    return (
        f"restart budget exhausted: {used} of fault_tolerance.max_restarts={budget} restarts used{since} "
        f"(preemptions not counted; fault_tolerance.progress_resets_budget_steps resets the count){_tried(incident)}"
    )


def _preemptions_spent(reg: RunRecord, cfg: Config, incident: Incident) -> str | None:
    used, budget = budget_used(reg, cfg, incident), cfg.fault_tolerance.max_preemptions
    if budget < 0 or used < budget:
        return None
    return (
        f"preemption budget exhausted: {used} of fault_tolerance.max_preemptions={budget} restarts after "
        f"preemptions{_tried(incident)}"
    )


def _tried(incident: Incident) -> str:
    """What the last restart that could not complete ran into, for a give-up's reason."""
    if not incident.failed_tries:
        return ""
    return f"; {incident.failed_tries} restart(s) could not complete, the last: {incident.last_try_error}"


def _same_failure(a: Incident, b: Incident) -> bool:
    return (
        a.failed_step == b.failed_step
        and a.kind == b.kind
        and (a.error.type if a.error else None) == (b.error.type if b.error else None)
    )
