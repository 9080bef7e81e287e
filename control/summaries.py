"""What a flow run returns, typed: the summary ``unbroken run`` / ``unbroken tune`` print (read by key in
unbroken/cli.py) and a Prefect flow run keeps as its result. Plain dicts at run time (JSON for Prefect's result),
checked by the type checker where they are made and read."""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

from pydantic import JsonValue

from control.records.series import Verdict
from ray_jobs.contracts.samples import Sample

TableRow = dict[str, JsonValue]  # a row of a table artifact (the metrics, a search's trials, the watchdog's incidents)


class VerdictSummary(TypedDict):
    """The promotion gate's verdict as the summary carries it (control/records/series.Verdict, dumped)."""

    promoted: bool
    why: str
    run: str
    series: str
    score: float | None
    champion: str | None
    champion_score: float | None


class RunSummary(TypedDict):
    """A trained run: its eval loss before and after, its held-out samples, its final model and series verdict."""

    run: str
    dataset_id: str
    steps: int
    first_eval_loss: float
    final_eval_loss: float
    final_train_loss: float
    exact_match: str  # "62/64", or "n/a" without samples
    samples: list[Sample]
    final_model: str
    verdict: NotRequired[VerdictSummary | None]  # set once the run is closed in its series


class SearchSummary(TypedDict):
    """A search: its trials (one table row each), the winner and the winner's final model."""

    run: str
    dataset_id: str
    trials: list[TableRow]
    winner: str | None
    final_model: str | None
    verdict: NotRequired[VerdictSummary | None]


class NothingNew(TypedDict):
    """The series already trained this dataset with this recipe: nothing ran."""

    run: str
    dataset_id: str
    nothing_new: Literal[True]
    message: str
    final_model: str | None


def verdict_summary(v: Verdict) -> VerdictSummary:
    return {
        "promoted": v.promoted,
        "why": v.why,
        "run": v.run,
        "series": v.series,
        "score": v.score,
        "champion": v.champion,
        "champion_score": v.champion_score,
    }
