"""The control plane's side of experiment tracking: a run that ends without its job ending it (the watchdog gave up,
the flow run was cancelled: rank 0 was stopped or is gone, and never closed its tracker runs) has them ended here, so
no MLflow or W&B run of ours stays "running" forever. What a run's trackers are and how each is ended:
``ray_jobs.train.tracking``."""

from __future__ import annotations

from control.logs import run_logger
from ray_jobs.config import Config


def end_tracker_runs(cfg: Config, status: str, why: str) -> list[str]:
    """End run ``cfg.name``'s tracker runs still open as ``status`` (``FAILED``, ``KILLED``); the trackers whose run
    it ended. Never raises (a tracker that cannot be reached is logged and left): ending a run never hinges on it."""
    if not cfg.tracking.enabled:
        return []
    from ray_jobs.train.tracking import end_runs

    ended = end_runs(cfg, status)
    if ended:
        run_logger().info("ended the %s run(s) of %s as %s: %s", " and ".join(ended), cfg.name, status, why)
    return ended
