"""The restart policy, as rules over the run record: when a restart is pointless or not allowed (an error in the
code or data, a deterministic failure, the restart budget spent), and how long to wait before the next one. Pure."""

from __future__ import annotations

from control.records.run import Incident, RunRecord
from ray_jobs.config import Config

# Exceptions that say the code or the config is wrong: the same job would fail the same way again.
USER_ERRORS = frozenset(
    {
        "ConfigError", "ValidationError", "RunConflict", "CheckpointInvalid", "SyntaxError", "ImportError",
        "ModuleNotFoundError", "NameError", "AttributeError", "TypeError", "KeyError", "IndexError", "ValueError",
        "AssertionError", "NotImplementedError", "ZeroDivisionError", "UnicodeDecodeError", "OutOfMemoryError",
    }
)  # fmt: skip
# Two failures in a row at the same step with the same error: deterministic, not bad luck.
SAME_FAILURE_LIMIT = 2


def backoff_s(cfg: Config, restarts_done: int) -> float:
    """Wait before restart number ``restarts_done + 1``: base, 2x base, 4x base ... capped."""
    ft = cfg.fault_tolerance
    return min(ft.restart_backoff_s * 2**restarts_done, ft.restart_backoff_max_s)


def budget_used(reg: RunRecord, cfg: Config, current: Incident) -> int:
    """Restarts counted against ``max_restarts``: those since the last attempt that trained at least
    ``progress_resets_budget_steps`` new steps before it failed, preemptions left out."""
    window = cfg.fault_tolerance.progress_resets_budget_steps
    if window and current.progress_steps >= window:
        return 0
    used = 0
    for inc in reg.incidents:
        if inc is current or inc.action != "restarted":
            continue
        if window and inc.progress_steps >= window:
            used = 0
        used += not inc.preempted
    return used


def give_up_reason(reg: RunRecord, cfg: Config, incident: Incident) -> str | None:
    """Why restarting again would be pointless or not allowed (naming the rule); None when a restart is in order."""
    if incident.preempted:
        return None
    return _user_error(incident) or _deterministic(reg, incident) or _budget_spent(reg, cfg, incident)


def _user_error(incident: Incident) -> str | None:
    error = incident.error or {}
    if USER_ERRORS.intersection(error.get("kinds") or [error.get("type")]):
        return (
            f"the job raised {error['type']}: {error.get('message', '')} -- an error in the code, data or config, "
            "which a restart would repeat"
        )
    return None


def _deterministic(reg: RunRecord, incident: Incident) -> str | None:
    past = [i for i in reg.incidents if i is not incident and i.action == "restarted"]
    same = [i for i in past[-(SAME_FAILURE_LIMIT - 1) :] if _same_failure(i, incident)]
    if incident.failed_step is not None and len(same) == SAME_FAILURE_LIMIT - 1:
        error = incident.error
        return (
            f"deterministic failure: {SAME_FAILURE_LIMIT} attempts in a row failed at step {incident.failed_step} "
            f"({incident.kind}{': ' + error['type'] if error else ''}); a restart would fail the same way"
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
        "(preemptions not counted; fault_tolerance.progress_resets_budget_steps resets the count)"
    )


def _same_failure(a: Incident, b: Incident) -> bool:
    return (
        a.failed_step == b.failed_step
        and a.kind == b.kind
        and (a.error or {}).get("type") == (b.error or {}).get("type")
    )
