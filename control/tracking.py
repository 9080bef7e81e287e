"""The control plane's side of experiment tracking: a run that ends without its job ending it (the watchdog gave up,
the flow run was cancelled: rank 0 was stopped or is gone, and never closed its tracker runs) has them ended here, so
no MLflow or W&B run of ours stays "running" forever. What a run's trackers are and how each is ended:
``ray_jobs.train.tracking``."""

from __future__ import annotations

import threading

from control.logs import run_logger
from ray_jobs.config import Config

END_WAIT_S = 30.0  # the most a watchdog pass or a cancel waits for a tracker's server (MLflow's client retries ~2 min)


def end_tracker_runs(cfg: Config, status: str, why: str, wait_s: float = END_WAIT_S) -> list[str]:
    """End run ``cfg.name``'s tracker runs still open as ``status`` (``FAILED``, ``KILLED``); the trackers whose run
    it ended. Never raises (a tracker that cannot be reached is logged and left), and waits at most ``wait_s``: a
    tracking server that does not answer must not hold up the watchdog's pass or a cancel (the ending goes on, on a
    daemon thread, and is logged as not done)."""
    if not cfg.tracking.enabled:
        return []
    from ray_jobs.train.tracking import end_runs

    done: list[list[str]] = []
    ending = threading.Thread(target=lambda: done.append(end_runs(cfg, status)), name="end-tracker-runs", daemon=True)
    ending.start()
    ending.join(wait_s)
    if not done:
        run_logger().warning(
            "the tracker runs of %s were not ended within %.0f s (a tracker that does not answer); "
            "they may show it running",
            cfg.name,
            wait_s,
        )
        return []
    if done[0]:
        run_logger().info("ended the %s run(s) of %s as %s: %s", " and ".join(done[0]), cfg.name, status, why)
    return done[0]
