"""A run's place in its series, as tasks: is there anything new to train, and where does the run start from (the
base model, or a warm start from the series) and what eval set is it scored on. The series record is
control/series/."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from control import series
from control.logs import run_logger
from control.records.series import EvalPin, SeriesRun
from ray_jobs.config import Config, ConfigError
from tasks.stage import Staged, stage_dataset


@dataclass
class Lineage:
    base: str  # model.name_or_path's folder: tokenization follows it
    start: str  # the weights the run starts from: the base, or a warm start's final folder
    parent: series.WarmStart | None  # the run warm-started from (series.warm_start)
    pin: EvalPin  # the series' fixed eval set

    @property
    def parent_run(self) -> str | None:
        return self.parent.run if self.parent else None


@task(name="check-series", cache_policy=NO_CACHE)
def check_series(cfg: Config) -> None:
    """``series.eval`` must exist before anything is staged or started (a ConfigError naming the field)."""
    series.check_eval_source(cfg)


@task(name="find-trained-run", cache_policy=NO_CACHE)
def find_trained_run(cfg: Config, dataset_id: str) -> SeriesRun | None:
    """The succeeded run of this series that trained this dataset with this recipe: nothing new to train."""
    return series.already_trained(cfg, dataset_id)


@task(name="plan-lineage", cache_policy=NO_CACHE)
def plan_lineage(cfg: Config, staged: Staged, base_model: str) -> Lineage:
    """Where this run starts from (the base model, or a warm start from the series) and the series' pinned eval set
    it is scored on (pinned, with the run's place in the series, once its attempt is recorded)."""
    log = run_logger()
    parent = series.warm_start(cfg)
    if cfg.model.init_from != "base" and parent is None:
        log.warning(
            "model.init_from=%s: series %s has no such run yet; starting from the base model %s",
            cfg.model.init_from,
            cfg.series_name,
            cfg.model.name_or_path,
        )
    pin = series.pinned_eval(cfg) or _eval_pin(cfg, staged, base_model)
    start = parent.final_model if parent else base_model
    if parent:
        log.info("warm start from run %s (%s): %s", parent.run, cfg.model.init_from, start)
    return Lineage(base_model, start, parent, pin)


def _eval_pin(cfg: Config, staged: Staged, base_model: str) -> EvalPin:
    """The series' fixed eval set for its first run: ``series.eval`` staged on its own, or this run's eval split."""
    if cfg.series.eval:
        ev = cfg.model_copy(deep=True)
        ev.data.train = ev.data.eval = cfg.series.eval
        staged, source = stage_dataset(ev, base_model), cfg.series.eval
    else:
        source = f"the eval split of run {cfg.name}"
    if not staged.counts.get("eval_rows"):
        raise ConfigError([f"series.eval: {source} has no eval rows to score the series' runs on; name an eval set"])
    return EvalPin(dataset_id=staged.dataset_id, manifest_url=staged.manifest_url, source=source)
