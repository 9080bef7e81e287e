"""``runs/<search>/trials.json``: each trial of a search as its driver last saw it. Written by a Ray Tune callback on
the search's driver (ray_jobs/search/progress.py); read by the search job's end, whoever closes or watches the search
(control/series/search.py: trial records, the winner, a restart's lost steps) and the flow's trials artifact."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import JsonValue

from ray_jobs.contracts.base import Part, Record

# ``pending`` -> ``running`` -> one of the last three, which are final.
TrialState = Literal["pending", "running", "completed", "stopped-early", "failed"]
DONE: tuple[TrialState, ...] = ("completed", "stopped-early", "failed")


class TrialEntry(Part):
    """One trial: its values, state, how many times Tune started it (a trial re-run after the driver was lost is a
    second start), its newest step and eval loss, the eval loss at every reported step, and a failed trial's error."""

    index: int
    params: dict[str, JsonValue]  # field -> the value drawn for it (a config value: JSON)
    state: TrialState = "pending"
    starts: int = 0
    step: int = 0
    eval_loss: float | None = None
    history: list[tuple[int, float | None]] = []  # (step, eval loss) in step order
    error: str | None = None


class Trials(Record):
    """The whole file: trial run name -> :class:`TrialEntry`, and when the driver last wrote it."""

    SCHEMA: ClassVar[int] = 1
    trials: dict[str, TrialEntry]
    updated_at: float | None = None
