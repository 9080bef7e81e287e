"""The series record ``<storage>/series/<series>/series.json`` and the champion pointer ``champion.json``, typed.

A series is the lineage of runs that retrain one model: each run with the dataset it trained on, the run it was
warm-started from, its score on the series' pinned eval set and the promotion verdict. The run record
(``runs/<run>/run.json``) stays the truth about a run's state; this file holds only lineage.

Version 1: the untyped files of earlier releases had these same fields and no version; they read as they are.
"""

from __future__ import annotations

from pydantic import Field, JsonValue

from ray_jobs.contracts.base import Part, Record


class EvalPin(Part):
    """The series' fixed eval set, pinned by its first run: every run of the series is scored on it, so scores
    compare across runs whatever data each trained on."""

    dataset_id: str
    manifest_url: str
    source: str  # what was staged: ``series.eval``'s path, or "the eval split of run <run>"


class Verdict(Part):
    """The promotion gate's decision on a finished run (also the payload of the promoted/rejected event)."""

    promoted: bool
    why: str
    run: str
    series: str
    score: float | None  # None: the run left no score.json, and is never promoted
    champion: str | None  # the champion it was judged against; None for the first scored run
    champion_score: float | None


class SeriesRun(Part):
    """One run of the series. Fields are declared in the order the untyped entries were written, so a file
    rewritten by this version keeps its keys in the same order."""

    run: str
    dataset_id: str
    recipe: str | None = None  # control.series.lineage.recipe: the model and training settings, hashed
    started_at: float | None = None
    parent: str | None = None  # the run it was warm-started from; None = the base model
    init_from: str = "base"  # model.init_from as the run was configured
    score: float | None = None  # eval loss on the series' pinned eval set, once the run ended
    verdict: Verdict | None = None  # set once, by whoever closed the run first
    flow_run_id: str | None = None  # the flow run that started it (its cancel/crash hooks look it up by this)
    ended_at: float | None = None
    final_deleted_at: float | None = None  # retention (series.keep_runs) deleted its final folder
    # a hyperparameter search's entry (``trials``: its trials' runs, ``winner``: the one put to the gate), and each
    # trial's (``search``: whose, ``params``: its values, ``state``: how it ended)
    trials: list[str] | None = None
    winner: str | None = None
    search: str | None = None
    params: dict[str, JsonValue] | None = None
    state: str | None = None
    steps: int | None = None  # the trial's last reported step


class SeriesRecord(Record):
    """``series/<series>/series.json``: the series' runs in the order they started, its pinned eval set and the
    name of its champion run."""

    series: str
    eval: EvalPin | None = None
    champion: str | None = None
    runs: list[SeriesRun] = Field(default_factory=list)
    updated_at: float | None = None

    @classmethod
    def new(cls, series: str) -> SeriesRecord:
        """A series before its first run (every field set, so the first file has them all, as it always had)."""
        return cls(schema_version=cls.SCHEMA, series=series, eval=None, champion=None, runs=[])

    def entry(self, run: str) -> SeriesRun | None:
        return next((e for e in self.runs if e.run == run), None)

    def champion_entry(self) -> SeriesRun | None:
        return self.entry(self.champion) if self.champion else None


class ChampionPointer(Record):
    """``series/<series>/champion.json``: which run's final folder is the champion, and the sha256 of every file in
    it (relative path -> digest), so a reader can check that it loads exactly what was judged."""

    run: str
    folder: str
    score: float
    files: dict[str, str]
    published_at: float
