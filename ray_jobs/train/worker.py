"""One rank's whole job, whatever starts it: Ray Train (``train_loop_per_worker``), torchrun or local mode
(``run_worker``): resume or start, train, score on the series' eval set, export, and end the run's tracker runs."""

from __future__ import annotations

import logging

from pydantic import JsonValue

from ray_jobs.config import Config, from_json
from ray_jobs.config.engines import Engine, engine_of, needs
from ray_jobs.config.epochs import resolve_epochs
from ray_jobs.config.record_formats import staged_format
from ray_jobs.contracts.job_spec import WorkerSpec
from ray_jobs.model.loading import forgo_bitsandbytes
from ray_jobs.secrets import mask_output
from ray_jobs.train.heartbeat import Heartbeat, start_heartbeat
from ray_jobs.train.runtime import Runtime
from ray_jobs.train.trainer import Trainer

log = logging.getLogger("unbroken.train")


def train_loop_per_worker(loop_config: dict[str, JsonValue]) -> None:
    """Entry point Ray Train runs on every worker (and re-runs after a worker-group restart). ``loop_config``: a
    :class:`WorkerSpec`'s JSON form (Ray Train's ``train_loop_config`` is a dict), parsed again here."""
    from ray_jobs.train.runtime import RayRuntime

    run_worker(WorkerSpec.model_validate(loop_config), RayRuntime())


def run_worker(spec: WorkerSpec, rt: Runtime) -> Trainer:
    """One rank's whole job, whatever runs it (Ray Train, torchrun, this process): resume or start, train, score on
    the series' eval set, export. ``spec``: what ``ray_jobs.job.loop_config`` makes of a job spec."""
    mask_output()  # a worker's log lines and tracebacks (a tracker's error quoting its URI) are masked here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = resolve_epochs(from_json(spec.config), spec.manifest)  # train.epochs -> its steps, as the flow did
    forgo_bitsandbytes(cfg.model.quantization)  # this process is this run's alone
    attempt = spec.attempt
    own = engine_of(cfg).own_heartbeat  # live recovery's: written by whichever replica leads
    heartbeat = start_heartbeat(cfg, attempt) if rt.rank == 0 and not own else None  # before the model loads
    trainer = None
    try:
        trainer = make_trainer(cfg, spec, rt, heartbeat)
        trainer.attempt, trainer.parent = attempt, spec.inputs.parent
        trainer.resume_or_start(spec.resume_from)
        trainer.fit()
        trainer.score(spec.score_manifest)
        final = trainer.export_final(spec.inputs.samples)
        _end_tracking(trainer, "FINISHED", final)
    except BaseException:
        _end_tracking(trainer, "FAILED", None)  # a restart of the worker group reopens the same tracker runs
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if trainer is not None:  # live recovery's: its replica leaves the quorum, its heartbeat stops
            trainer.close()
    after = {k: v - trainer.warmup[k] for k, v in trainer.cache.counters().items()}  # what training itself read
    log.info(
        "rank %d shard cache after warm-up: %s; checkpoint stalls (s): %s",
        trainer.rt.rank,
        after,
        [round(s, 4) for s in trainer.checkpointer.stalls_s],
    )
    return trainer


def make_trainer(cfg: Config, spec: WorkerSpec, rt: Runtime, heartbeat: Heartbeat | None) -> Trainer:
    """The trainer of this rank: the class of ``cfg``'s engine (its row in ``ray_jobs/config/engines.py``), built
    for this worker."""
    engine = engine_of(cfg)
    if staged_format(spec.manifest.format).pairs and not engine.preference:  # data.format=auto found them
        raise ValueError(
            "data.format: the records are preference pairs, trained by DPO (TRL's DPOTrainer), which needs "
            + needs("preference")
        )
    return trainer_class(engine).for_worker(cfg, spec, rt, heartbeat)


def trainer_class(engine: Engine) -> type[Trainer]:
    """The trainer class an engine's row names (``module:Class``), imported now: on the worker alone."""
    import importlib

    module, _, name = engine.trainer.partition(":")
    return getattr(importlib.import_module(module), name)


def _end_tracking(trainer: Trainer | None, status: str, final_model: str | None) -> None:
    trackers = getattr(trainer.metrics, "trackers", None) if trainer is not None and trainer.metrics else None
    if trackers is not None:
        trackers.close(status, final_model)
