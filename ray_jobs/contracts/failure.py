"""The root cause a failed job prints for the watchdog: one ``UNBROKEN_FAILURE <json>`` line in the job's log (the
Jobs API's logs are the one channel a job's driver and the watchdog both have), written by ``ray_jobs.job`` and
``ray_jobs.search_job``, read by ``control/watchdog/observe.py``, kept on the run record's incident."""

from __future__ import annotations

import json
from typing import Self

from ray_jobs.contracts.base import Part

PREFIX = "UNBROKEN_FAILURE "


class JobFailure(Part):
    """What a worker raised, under Ray Train's wrappers: its type name, its classes (a policy that refuses to retry
    ValueError must see peft's NoMatchingPeftModuleError), the first line of its message, and whether it was a
    preemption Ray Train could not absorb (the platform's doing, kept out of the run's failure budget)."""

    type: str
    message: str = ""
    kinds: list[str] = []
    preempted: bool = False
    user: bool = False  # a user's mistake (ray_jobs.errors.UserError): the input's, which a restart would repeat

    def line(self) -> str:
        """The line the job prints."""
        return PREFIX + json.dumps(self.model_dump(mode="json"))

    def names(self) -> list[str]:
        """Its classes, or its type name alone when the job printed no classes (an older job's line)."""
        return self.kinds or [self.type]

    @classmethod
    def last_in(cls, logs: str) -> Self | None:
        """The last failure line of a job's logs, or None when there is none or it cannot be read as one (a driver
        killed mid-line, another version's fields): no root cause, never an exception in a watchdog's pass."""
        lines = [ln for ln in logs.splitlines() if ln.startswith(PREFIX)]
        if not lines:
            return None
        try:
            return cls.model_validate_json(lines[-1].removeprefix(PREFIX))
        except ValueError:  # pydantic's ValidationError is one
            return None
