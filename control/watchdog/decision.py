"""What a decision is made of (control/watchdog/decide.py makes it, act.py carries it out): the side effects to
carry out, one class each, and the :class:`Decision` with its :class:`Outcome` -- what to report. Data only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from control.records.run import Incident, RunRecord


@dataclass(frozen=True)
class Save:
    """Write the decided record (under the run's lease)."""


@dataclass(frozen=True)
class Restart:
    """Restart -- decided maybe a backoff ago, so the pass looks once more right before it and decides on that look
    (:func:`control.watchdog.decide.recheck`): a :class:`Resubmit`, or the incident stood down."""


@dataclass(frozen=True)
class Resubmit:
    """Stop what is left of the job, re-provision, resume from the newest valid checkpoint under a new submission
    (control/watchdog/restart.py)."""


@dataclass(frozen=True)
class Reattach:
    """The job's driver is gone while its run host trains on: submit a driver that re-attaches to it (no restart,
    nothing counted; control/watchdog/reattach.py)."""


@dataclass(frozen=True)
class GiveUp:
    """Stop what is left of the job (best effort), record the run failed, release its cluster."""


@dataclass(frozen=True)
class ReleaseCluster:
    """The run is over and no flow is left to release its cluster: its backend's ``down``."""


@dataclass(frozen=True)
class CloseRun:
    """Close the succeeded run no flow is left to close: score it in its series, release its cluster unless kept
    (control/attempt.close_run, the flow's closing too)."""


@dataclass(frozen=True)
class ReplaceNodes:
    """Ask the backend for the cluster's lost nodes back; the health incident ``detail`` records what it did."""

    detail: str


@dataclass(frozen=True)
class Log:
    level: str  # info | warning | error
    message: str


@dataclass
class Outcome:
    run: str
    # ok | observing | reattached | succeeded | closed | restarted | restart-failed | waiting | gave-up | skipped |
    # inactive |
    # elsewhere (a local head on another host) | unreadable (a record this release cannot read) | storage-unreachable
    action: str
    detail: str = ""
    incident: Incident | None = None


@dataclass
class Decision:
    record: RunRecord  # the record as it should be (a copy: the observed one is left as it was)
    actions: list[Any]
    outcome: Outcome
