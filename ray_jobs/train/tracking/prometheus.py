"""Live metrics for Prometheus through Ray's metrics API: rank 0 sets gauges, and the dashboard agent of its node
serves them at ``http://<node>:<metrics export port>/metrics`` next to Ray's own, prefixed ``ray_``
(``ray_unbroken_train_step{run=...,series=...}``).

On whenever the training process is a Ray worker (``open_trackers``), whatever ``tracking:`` says: setting a gauge
costs next to nothing and nothing is written anywhere unless someone scrapes. Ray forgets a gauge that was not set
for two of its report intervals (``RAY_metrics_report_interval_ms``, 10 s by default), so every gauge is set again
from its last value every half interval until the tracker closes: a run's series stay up between logged rows
however slow its steps, and vanish soon after its training process ends.

``unbroken_restarts`` counts the restarts behind the process now training: every watchdog restart is a new job
attempt (``attempt - 1`` of them), and every in-job restart (Ray Train starting the worker group again after a
failure, a preemption or an elastic resize) a new rank-0 process of the same attempt, which finds how many came
before it in ``runs/<run>/train-starts.json``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ray_jobs.storage import Layout, read_bytes, write_json_atomic
from ray_jobs.train.tracking.hub import RunInfo

if TYPE_CHECKING:  # Ray is imported when the gauges are made
    from ray.util.metrics import Gauge

log = logging.getLogger("unbroken.tracking")

TAGS = ("run", "series")
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"  # Ray's own name for it (RayConfig), lower case and all
# gauge -> (the tracked row column it shows, or None: set by the tracker itself; description)
GAUGES: dict[str, tuple[str | None, str]] = {
    "unbroken_train_step": (None, "last optimizer step logged"),
    "unbroken_train_loss": ("train/loss", "training loss at the last logged step"),
    "unbroken_eval_loss": ("eval/loss", "loss on the eval split at the last eval"),
    "unbroken_learning_rate": ("train/lr", "learning rate at the last logged step"),
    "unbroken_grad_norm": ("train/grad_norm", "gradient norm (before clipping) at the last logged step"),
    "unbroken_tokens_per_second": ("perf/tokens_per_s", "trained tokens per second, every worker together"),
    "unbroken_checkpoint_stall_seconds": ("perf/checkpoint_stall_s", "training time the last checkpoint blocked"),
    "unbroken_mfu": (None, "model FLOPs utilisation (0..1); only on GPUs whose peak is known"),
    "unbroken_restarts": (None, "restarts behind the training process: watchdog restarts + in-job restarts"),
    "unbroken_replicas_participating": ("live/participants", "live recovery: replicas that trained the last step"),
    "unbroken_replicas_healed": ("live/heals", "live recovery: lost replicas replaced and healed from a peer"),
    "unbroken_job_attempt": (None, "the job attempt training (1, then one more per watchdog restart)"),
}


def refresh_s() -> float:
    """Half of Ray's metrics report interval (as this process's Ray has it), between 0.25 and 5 s."""
    try:
        interval_ms = float(os.environ.get(REPORT_INTERVAL_ENV, "10000"))
    except ValueError:
        interval_ms = 10000.0
    return min(5.0, max(0.25, interval_ms / 2000.0))


class PrometheusTracker:
    name = "prometheus"

    def __init__(self, flops_per_token: float | None = None, peak_flops: float | None = None):
        """``flops_per_token`` of the model and ``peak_flops`` of every GPU together: the MFU gauge, when both are
        known (None on CPU, or a card without a known peak)."""
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.values: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gauges: dict[str, Gauge] = {}
        self.links: dict[str, str] = {}  # none to record: the gauges are where Ray serves its metrics

    def open(self, info: RunInfo) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"run": info.run, "series": info.series}
        self._gauges = {name: Gauge(name, description, tag_keys=TAGS) for name, (_, description) in GAUGES.items()}
        attempt = max(info.attempt, 1)
        in_job = count_start(Layout(info.storage).train_starts(info.run), attempt)
        self._set(
            {
                "unbroken_restarts": attempt - 1 + in_job,
                "unbroken_job_attempt": attempt,
                "unbroken_train_step": info.resumed_step or 0,
            }
        )
        self._keeper = threading.Thread(target=self._keep_alive, name="tracker-prometheus-refresh", daemon=True)
        self._keeper.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        new: dict[str, float] = {"unbroken_train_step": step}
        for gauge, (column, _) in GAUGES.items():
            if column is not None and column in metrics:
                new[gauge] = metrics[column]
        tps = metrics.get("perf/tokens_per_s")
        if tps is not None and self.flops_per_token and self.peak_flops:
            new["unbroken_mfu"] = tps * self.flops_per_token / self.peak_flops
        self._set(new)

    def close(self, status: str, final_model: str | None) -> None:
        """No more refreshes: Ray drops the run's series two report intervals from now."""
        self._stop.set()

    def _set(self, new: dict[str, float]) -> None:
        with self._lock:
            self.values.update(new)
            for name, value in self.values.items():
                self._gauges[name].set(float(value), tags=self.tags)

    def _keep_alive(self) -> None:
        every = refresh_s()
        while not self._stop.wait(every):
            try:
                self._set({})
            except Exception as e:  # a refresh that fails now may not later; the run never waits for it
                log.debug("prometheus refresh failed: %s", e)


def live_tracker(cfg: Any, model: Any = None, seq_len: int = 0, world_size: int = 1) -> list[PrometheusTracker]:
    """``[the tracker]`` when this process is connected to Ray (a Ray Train worker), else ``[]`` (local mode,
    tests). The MFU basis only for a GPU run whose card's peak is known."""
    import sys

    ray = sys.modules.get("ray")  # never imported here for the asking: a process that has not is no Ray worker
    if ray is None or not ray.is_initialized():
        return []
    flops = peak = None
    if cfg.cluster.use_gpu and model is not None:
        from ray_jobs.train.flops import flops_per_token, gpu_peak_flops

        peak = gpu_peak_flops()
        flops = flops_per_token(model, seq_len) if peak else None
        peak = peak * world_size if peak else None
    return [PrometheusTracker(flops, peak)]


def count_start(url: str, attempt: int) -> int:
    """This attempt's rank-0 processes that started before this one (its in-job restarts); counted on storage in
    ``url``, the run's ``train-starts.json`` (a run's rank 0 is one process at a time). Storage out of reach: 0, and
    the run goes on."""
    try:
        seen = json.loads(read_bytes(url))
    except FileNotFoundError:
        seen = {}
    except Exception as e:  # storage away, a torn file: never a reason to lose the other gauges
        log.warning("could not read %s (%s): in-job restarts counted from 0", url, e)
        seen = {}
    starts = seen.get("starts", 0) + 1 if seen.get("attempt") == attempt else 1
    try:
        write_json_atomic(url, {"attempt": attempt, "starts": starts, "at": time.time()})
    except Exception as e:
        log.warning("could not write %s (%s): the next in-job restart may be missed", url, e)
    return starts - 1
