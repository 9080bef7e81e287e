"""Experiment trackers for a run (the design: :mod:`ray_jobs.train.tracking.hub`); :func:`open_trackers` makes those
``cfg.tracking`` names, :func:`end_runs` ends their runs when the run's job could not (the control plane's side)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ray_jobs.secrets import mask_tree
from ray_jobs.train.tracking.hub import METRICS, RunInfo, Tracker, Trackers, tracked

__all__ = ["METRICS", "RunInfo", "Tracker", "Trackers", "end_runs", "flat_params", "open_trackers", "run_info",
           "tracked"]  # fmt: skip

log = logging.getLogger("unbroken.tracking")


def open_trackers(
    cfg,
    attempt: int,
    dataset_id: str,
    resumed_step: int | None,
    model: Any = None,
    seq_len: int = 0,
    world_size: int = 1,
    parent: str | None = None,
) -> Trackers | None:
    """The trackers ``cfg.tracking`` names, and Prometheus gauges whenever this process is a Ray worker (``model``,
    ``seq_len`` and ``world_size`` give them an MFU on a GPU), each opening its run on its own thread (None when
    none is on)."""
    made: list[Tracker] = [_module(name).TRACKER(getattr(cfg.tracking, name)) for name in cfg.tracking.enabled]
    from ray_jobs.train.tracking.prometheus import live_tracker

    made += live_tracker(cfg, model, seq_len, world_size)
    if not made:
        return None
    return Trackers(made, run_info(cfg, attempt, dataset_id, resumed_step, parent))


def _module(name: str) -> ModuleType:
    """The module of the tracker a ``tracking.<name>`` section switches on: ``ray_jobs/train/tracking/<name>.py``,
    its ``TRACKER`` class and, where its runs can be left open, ``end_run``. A new tracker is that module and its
    section in ``ray_jobs/config/tracking.py``; nothing else names it. Imported only when switched on: each module
    loads its library only when there is work."""
    return importlib.import_module(f"ray_jobs.train.tracking.{name}")


def run_info(
    cfg, attempt: int = 0, dataset_id: str = "", resumed_step: int | None = None, parent: str | None = None
) -> RunInfo:
    """What every tracker is told of the run; its params are the config masked (a tracker stores and shows them)."""
    from ray_jobs.storage import Layout

    return RunInfo(
        cfg.name,
        cfg.series_name,
        cfg.storage,
        Layout(cfg.storage).run_dir(cfg.name),
        attempt,
        dataset_id,
        parent,
        resumed_step,
        flat_params(mask_tree(cfg.model_dump(mode="json"))),
    )


def end_runs(cfg, status: str) -> list[str]:
    """End the tracker runs of run ``cfg.name`` that its job left open (the watchdog gave up on it, it was
    cancelled: its rank 0 never closed them) as ``status`` (``FAILED``, ``KILLED``); the names of the trackers whose
    run it ended. Never raises: a tracker that cannot be reached is logged and left. TensorBoard has no run state;
    an MLflow run still RUNNING is terminated; an offline W&B run gets a closing folder (see ``wandb.end_run``)."""
    info = run_info(cfg)
    ended = []
    for name in cfg.tracking.enabled:
        end_run = getattr(_module(name), "end_run", None)  # a tracker without run state (TensorBoard) has none
        if end_run is None:
            continue
        section = getattr(cfg.tracking, name)
        try:
            if end_run(section, info, status):
                ended.append(name)
        except Exception as e:  # a tracker down or misconfigured is never the control plane's failure
            log.warning("could not end the %s run of %s (%s: %s)", name, cfg.name, type(e).__name__, e)
    return ended


def flat_params(tree: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"train.lr": 1e-4, ...}``: a config as the flat key/value pairs trackers take as params."""
    out: dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flat_params(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
