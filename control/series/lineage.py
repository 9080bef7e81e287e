"""The series record's store and the lineage questions the flow asks of it: what this series already trained, where
a run warm-starts from, which eval set it is scored on, and the run's place in the series once it starts.

The record (control/records/series.py) is a whole-file JSON replaced atomically, and every writer holds the series'
lease (control/lease.py), so a flow and a watchdog finishing two runs of one series never interleave.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from control import lease as leases
from control import registry
from control.records.series import EvalPin, SeriesRecord, SeriesRun
from ray_jobs.config import Config, without_later_defaults
from ray_jobs.search.trials import trials
from ray_jobs.secrets import mask_tree
from ray_jobs.storage import Layout, exists, write_json_atomic

T = TypeVar("T")
INIT_FROM = {"series-champion": "champion", "series-latest": "latest"}


@dataclass(frozen=True)
class WarmStart:
    """The run a new run starts from (``model.init_from``) and the final folder it loads."""

    run: str
    final_model: str
    init_from: str


def load(storage: str, series: str) -> SeriesRecord | None:
    """The series' record (an older version's file migrated), or None before its first run."""
    return SeriesRecord.read(Layout(storage).series_registry(series))


def runs(storage: str, series: str) -> list[SeriesRun]:
    """The series' runs in the order they started (none for a series without a record)."""
    rec = load(storage, series)
    return rec.runs if rec else []


def mutate(storage: str, series: str, change: Callable[[SeriesRecord], T]) -> T:
    """Read (or start) the series record, apply ``change``, write it back -- all under the series' lease."""
    lay = Layout(storage)
    with leases.acquire_wait(storage, f"series {series}", lease_dir=lay.series_lease_dir(series)):
        rec = load(storage, series) or SeriesRecord.new(series)
        out = change(rec)
        rec.updated_at = time.time()
        write_json_atomic(lay.series_registry(series), rec.dump(), durable=True)
        return out


def recipe(cfg: Config) -> str:
    """What a run trains besides its data: the model and training settings (not how many samples it prints).
    Two runs with the same dataset and recipe train the same thing."""
    # masked: a rotated password in a model URL is the same recipe (and the hash is of nothing secret)
    # at its default, a field added later hashes as before: old runs match (ray_jobs/config: ADDED_LATER)
    tree = without_later_defaults(mask_tree(json.loads(cfg.model_dump_json(include={"model", "train"})), ()))
    tree["train"].pop("sample_generations", None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def state_of(storage: str, run: str) -> str:
    """The run's state as its run record says (the truth about a run; the series record holds only lineage)."""
    reg = registry.load(storage, run)
    return reg.state if reg else "unknown"


def already_trained(cfg: Config, dataset_id: str) -> SeriesRun | None:
    """The succeeded run of this series that trained this dataset with this recipe, if any: nothing new to train."""
    mine = recipe(cfg)
    for e in reversed(runs(cfg.storage, cfg.series_name)):
        if e.dataset_id == dataset_id and e.recipe == mine and state_of(cfg.storage, e.run) == "succeeded":
            return e
    return None


def trained_this_recipe(cfg: Config) -> bool:
    """Whether some succeeded run of this series trained with this recipe (on any data): only then can a run of it
    turn out to have nothing new to train."""
    mine = recipe(cfg)
    return any(
        e.recipe == mine and state_of(cfg.storage, e.run) == "succeeded" for e in runs(cfg.storage, cfg.series_name)
    )


def warm_start(cfg: Config) -> WarmStart | None:
    """The run ``model.init_from`` names (the champion, or the newest succeeded run) with its final folder, or None
    for ``base`` and for a series that has no such run yet."""
    which = INIT_FROM.get(cfg.model.init_from)
    rec = load(cfg.storage, cfg.series_name) if which else None
    if rec is None:
        return None
    if which == "champion":
        run = rec.champion
    else:
        winners = {e.winner for e in rec.runs if e.trials is not None}  # a search's latest model is its winner's
        done = [
            e.run
            for e in rec.runs
            if e.trials is None
            and (e.search is None or e.run in winners)
            and state_of(cfg.storage, e.run) == "succeeded"
        ]
        run = done[-1] if done else None
    if run is None:
        return None
    return WarmStart(run, Layout(cfg.storage).final_model(run), cfg.model.init_from)


def pinned_eval(cfg: Config) -> EvalPin | None:
    rec = load(cfg.storage, cfg.series_name)
    return rec.eval if rec else None


def check_eval_source(cfg: Config) -> None:
    """``series.eval`` must exist before anything is staged or started (a clear error naming the field)."""
    from ray_jobs.config import ConfigError

    if cfg.series.eval and pinned_eval(cfg) is None and not exists(cfg.series.eval):
        raise ConfigError([f"series.eval: no such file or folder: {cfg.series.eval}"])


def begin_run(cfg: Config, dataset_id: str, eval_pin: EvalPin, parent: str | None, flow_run_id: str | None) -> EvalPin:
    """Record the run in its series (once; a resumed run keeps its entry), warm-started from run ``parent`` (None:
    the base model), and pin the series' eval set if this is the first run. Returns the pinned eval set (the one
    every run of the series is scored on)."""

    def change(rec: SeriesRecord) -> EvalPin:
        rec.eval = rec.eval or eval_pin
        e = rec.entry(cfg.name)
        if e is None:
            search = cfg.tune is not None  # a search trains no recipe of its own: its trials do
            children = trial_entries(cfg, dataset_id, parent) if search else []
            e = SeriesRun(
                run=cfg.name,
                dataset_id=dataset_id,
                recipe=None if search else recipe(cfg),
                started_at=time.time(),
                parent=parent,
                init_from=cfg.model.init_from,
                score=None,
                verdict=None,
            )
            if search:  # set only for a search: a field never set is not written (ray_jobs/contracts/base.py)
                e.trials = [c.run for c in children]
            rec.runs += [e, *children]
        e.flow_run_id = flow_run_id or e.flow_run_id
        return rec.eval

    return mutate(cfg.storage, cfg.series_name, change)


def trial_entries(cfg: Config, dataset_id: str, parent: str | None) -> list[SeriesRun]:
    """The series entries of a search's trials, added with the search's own when it starts: the lineage shows the
    search as one entry with its children."""
    now = time.time()
    return [
        SeriesRun(
            run=t.name,
            dataset_id=dataset_id,
            recipe=recipe(t.config),
            started_at=now,
            parent=parent,
            init_from=cfg.model.init_from,
            search=cfg.name,
            params=t.params,
            state="pending",
        )
        for t in trials(cfg)
    ]


def run_of_flow_run(storage: str, series: str, flow_run_id: str) -> str | None:
    """Which run a flow run resolved its name template to (its cancel/crash hooks need it)."""
    return next((e.run for e in runs(storage, series) if e.flow_run_id == flow_run_id), None)
