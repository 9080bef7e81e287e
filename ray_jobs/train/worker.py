"""One rank's whole job, whatever starts it: Ray Train (``train_loop_per_worker``), torchrun or local mode
(``run_worker``): resume or start, train, score on the series' eval set, export, and end the run's tracker runs."""

from __future__ import annotations

import logging
from typing import Any

from ray_jobs.config import from_json
from ray_jobs.model.loading import forgo_bitsandbytes
from ray_jobs.secrets import mask_output
from ray_jobs.train.heartbeat import start_heartbeat
from ray_jobs.train.runtime import Runtime
from ray_jobs.train.trainer import Trainer

log = logging.getLogger("unbroken.train")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker (and re-runs after a worker-group restart)."""
    from ray_jobs.train.runtime import RayRuntime

    run_worker(loop_config, RayRuntime())


def run_worker(loop_config: dict[str, Any], rt: Runtime) -> Trainer:
    """One rank's whole job, whatever runs it (Ray Train, torchrun, this process): resume or start, train, score on
    the series' eval set, export. ``loop_config``: what ``ray_jobs.job.loop_config`` makes of a job spec."""
    mask_output()  # a worker's log lines and tracebacks (a tracker's error quoting its URI) are masked here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = from_json(loop_config["config"])
    forgo_bitsandbytes(cfg.model.quantization)  # this process is this run's alone
    attempt = loop_config.get("attempt", 0)
    live = cfg.fault_tolerance.live_recovery
    heartbeat = start_heartbeat(cfg, attempt) if rt.rank == 0 and not live else None  # before the model loads
    trainer = None
    try:
        trainer = _make_trainer(cfg, loop_config, rt, heartbeat, attempt)
        trainer.attempt, trainer.parent = attempt, loop_config.get("parent")
        trainer.resume_or_start(loop_config.get("resume_from"))
        trainer.fit()
        trainer.score(loop_config.get("score_manifest"))
        final = trainer.export_final()
        _end_tracking(trainer, "FINISHED", final)
    except BaseException:
        _end_tracking(trainer, "FAILED", None)  # a restart of the worker group reopens the same tracker runs
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        close = getattr(trainer, "close", None)  # live recovery's: its replica leaves the quorum, its heartbeat stops
        if close is not None:
            close()
    after = {k: v - trainer.warmup[k] for k, v in trainer.cache.counters().items()}  # what training itself read
    log.info("rank %d shard cache after warm-up: %s; checkpoint stalls (s): %s", trainer.rt.rank, after,
             [round(s, 4) for s in trainer.checkpointer.stalls_s])  # fmt: skip
    return trainer


def _make_trainer(cfg, loop_config: dict[str, Any], rt: Runtime, heartbeat, attempt: int) -> Trainer:
    manifest, model_path = loop_config["manifest"], loop_config["model_path"]
    if manifest["staging_config"]["format"] == "preference" and cfg.train.engine != "hf":  # data.format=auto found it
        raise ValueError("data.format: the records are preference pairs, trained by DPO (TRL's DPOTrainer), which "
                         "needs train.engine=hf")  # fmt: skip
    if cfg.fault_tolerance.live_recovery:
        from ray_jobs.train.live_trainer import LiveTrainer

        return LiveTrainer(cfg, manifest, model_path, rt, attempt, loop_config.get("group", 0))
    if cfg.train.engine == "hf":
        from ray_jobs.train.hf import HfTrainer

        return HfTrainer(cfg, manifest, model_path, rt, heartbeat)
    return Trainer(cfg, manifest, model_path, rt, heartbeat)


def _end_tracking(trainer: Trainer | None, status: str, final_model: str | None) -> None:
    trackers = getattr(trainer.metrics, "trackers", None) if trainer is not None and trainer.metrics else None
    if trackers is not None:
        trackers.close(status, final_model)
