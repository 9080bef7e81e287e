"""The search's Tuner: each trial a Ray Train run of the project's trainer, built fresh or restored from storage.

Trials are Tune's grid over trial indices (their values were drawn from the config: ray_jobs/search/trials.py).
Each trial's function builds the same ``TorchTrainer`` a training job does (``ray_jobs.job.build_trainer``), under
the trial's run name, with Tune's ``TuneReportCallback`` so rank 0's reports (eval loss with every checkpoint)
reach the scheduler. A trial's workers resume from the trial's newest valid checkpoint like any run's, whether Ray
Train restarted them (a worker died) or Tune re-ran the trial (the search was restored).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import JsonValue

from ray_jobs.config import Config, fitting_trials, from_json
from ray_jobs.contracts.job_spec import WorkerSpec
from ray_jobs.search.progress import TrialProgress
from ray_jobs.search.scheduler import make_scheduler
from ray_jobs.search.trials import Trial
from ray_jobs.storage import Layout, join, pyarrow_filesystem, strip_protocol

log = logging.getLogger("unbroken.search")
DRIVER_MEMORY = 64 * 2**20  # bytes of Ray's logical memory resource a trial's driver asks for


def run_trial(config: dict[str, JsonValue], loops: list[WorkerSpec]) -> None:
    """One trial (Tune's function trainable): the trial's run, trained to its end or until Tune stops it.
    ``config``: Tune's param space for it, ``{"trial": index}``."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from ray_jobs.job import build_trainer

    index = config["trial"]
    assert isinstance(index, int), "the search's param space is a grid of trial indices (search_job)"
    loop = loops[index]
    build_trainer(from_json(loop.config), loop, callbacks=[TuneReportCallback()]).fit()


def experiment(cfg: Config) -> tuple[str, Any]:
    """Where Tune keeps the search's experiment state: ``<storage>/ray/<search>`` (path, pyarrow filesystem)."""
    url = join(Layout(cfg.storage).ray_storage(), cfg.name)
    fs = pyarrow_filesystem(url)
    return (strip_protocol(url) if fs is not None else url), fs


def build_tuner(cfg: Config, trials: list[Trial], loops: list[WorkerSpec], cpus: float) -> Any:
    """Restore the search's experiment when storage has one (finished and early-stopped trials stay as they are,
    running and errored ones resume, pending ones start); else a new one."""
    from ray import tune

    # A trial's function only drives its Ray Train run (its workers hold the CPUs): it asks for no CPU, so a cluster
    # with room for N trials' workers runs N trials. Tune refuses a trial that asks for nothing at all; a little of
    # Ray's logical ``memory`` resource is what it asks for instead.
    trainable = tune.with_resources(tune.with_parameters(run_trial, loops=loops), {"memory": DRIVER_MEMORY})
    path, fs = experiment(cfg)
    if tune.Tuner.can_restore(path, storage_filesystem=fs):
        log.info("restoring search %s from %s", cfg.name, path)
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=True, storage_filesystem=fs)
    root = Layout(cfg.storage).ray_storage()
    t = cfg.tune
    assert t is not None, "a search's Tuner is built after its trials, which refuse a config with no tune section"
    return tune.Tuner(
        trainable,
        param_space={"trial": tune.grid_search([tr.index for tr in trials])},
        tune_config=tune.TuneConfig(
            metric=t.metric,
            mode="min",
            scheduler=make_scheduler(cfg),
            max_concurrent_trials=t.max_concurrent_trials or fitting_trials(cfg, cpus),
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=cfg.name,
            storage_path=strip_protocol(root) if fs is not None else root,
            storage_filesystem=fs,
            callbacks=[TrialProgress(cfg, trials)],
            failure_config=tune.FailureConfig(max_failures=cfg.fault_tolerance.max_failures),
        ),
    )
