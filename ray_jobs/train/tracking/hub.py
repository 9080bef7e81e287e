"""Experiment trackers (TensorBoard, MLflow, W&B) fed with the run's metrics rows by rank 0, off the training thread.

What Ray Train V2 asks of trackers (its RunConfig takes no tracker callbacks): rank 0 calls them inside the train
function and keeps one tracker run across restores. Each tracker here has a thread and a queue of its own, fed by
:class:`Trackers` as the metrics log takes a row, so a tracker that is slow, hangs, or is down never delays a step
or another tracker; its first error is logged once (with what it means: no more points there) and it is switched off.

One run of ours is one run in each tracker, each logged step once, whatever restarted it (an in-job restart, a
watchdog restart from an older checkpoint, a resume after the whole cluster was lost). Every restart resumes from a
checkpoint at some step ``s`` and trains ``s+1..`` again, bit-identically on CPU; so every tracker opens with
``resumed_step`` and makes its run hold each step once, in its own way (see each tracker's module): TensorBoard purges from step 0 (its reader drops the older
files' points) and writes ``1..s`` again from the run's metrics log, W&B rewinds its run and does the same, and MLflow,
which cannot drop a point, reopens the same run (found by its ``unbroken.run`` tag) and logs only the points it does
not hold. (A killed process loses what its tracker had not written yet: a queue, a writer's buffer; the metrics log
keeps ``1..s`` whatever happened, which is why the trackers take those steps from it.)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray_jobs.contracts.metrics import MetricsRow

log = logging.getLogger("unbroken.tracking")

# The row columns trackers are given, under the names they show them as.
METRICS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "ckpt_stall_s": "perf/checkpoint_stall_s",
    "participants": "live/participants",
    "heals": "live/heals",
    "reward_accuracy": "dpo/reward_accuracy",
    "reward_margin": "dpo/reward_margin",
    "eval_reward_accuracy": "dpo/eval_reward_accuracy",
}  # fmt: skip  (live/: live recovery's; dpo/: preference tuning's, train.engine=hf)


@dataclass
class RunInfo:
    """What a tracker is told of the run it tracks."""

    run: str
    series: str
    storage: str
    run_dir: str  # the run's folder on storage
    attempt: int = 0
    dataset_id: str = ""
    parent: str | None = None  # the run this one warm-started from, if any
    resumed_step: int | None = None  # the checkpoint's step this process resumed from; None: a fresh start
    params: dict[str, object] = field(default_factory=dict)  # the flattened config


class Tracker(Protocol):
    """``links``: where the run can be looked at (a folder, a run id, a URL), known once ``open`` ran."""

    name: str
    links: dict[str, str]

    def open(self, info: RunInfo) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str, final_model: str | None) -> None: ...


def tracked(row: MetricsRow) -> dict[str, float]:
    """The metrics of one log row, under the trackers' names (non-numbers left out)."""
    return {name: float(row[k]) for k, name in METRICS.items() if isinstance(row.get(k), int | float)}


def kept(info: RunInfo) -> list[tuple[int, dict[str, float]]]:
    """The steps up to the resumed one, as the run's metrics log keeps them and trackers are given them (none on a
    fresh start): what a tracker writes again when it cannot trust that it holds them -- the process before this
    one was killed with points still in its queue or its writer's buffer."""
    if info.resumed_step is None:
        return []
    from ray_jobs.storage import Layout
    from ray_jobs.train.metrics import read_rows

    rows = read_rows(Layout(info.storage).metrics(info.run))
    return [(int(r["step"]), m) for r in rows if r["step"] <= info.resumed_step and (m := tracked(r))]


_CLOSE = object()
_LINKS_LOCK = threading.Lock()  # the lanes of one process write one links file


class _Lane:
    """One tracker on a thread of its own: open, then every queued row, then close; the first error switches it off."""

    def __init__(self, tracker: Tracker, info: RunInfo):
        self.tracker, self.info = tracker, info
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.failed: str | None = None
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tracker-{tracker.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self._call("open", self.info)
        if self.failed is None and getattr(self.tracker, "links", None):
            self._call("links", self.tracker.name, self.tracker.links)
        while True:
            item = self.items.get()
            if item is _CLOSE:
                break
            if self.failed is None and item[1]:
                self._call("log", *item)
        self._call("close", *self._closing)
        self.closed.set()

    def _call(self, what: str, *args: Any) -> None:
        if self.failed is not None:
            return
        try:
            (self.record_links if what == "links" else getattr(self.tracker, what))(*args)
        except Exception as e:  # any failure of a tracker: logged once, never the run's
            self.failed = f"{type(e).__name__}: {e}"
            log.warning(
                "tracker %s failed to %s (%s); the run goes on without it", self.tracker.name, what, self.failed
            )

    def close(self, status: str, final_model: str | None) -> None:
        self._closing = (status, final_model)
        self.items.put(_CLOSE)

    def record_links(self, name: str, links: dict[str, str]) -> None:
        """Add this tracker's links to ``runs/<run>/tracking.json`` (what the flow's report and a person follow)."""
        from ray_jobs.contracts.base import RecordError
        from ray_jobs.contracts.tracking import TrackingLinks
        from ray_jobs.storage import Layout, write_json_atomic

        with _LINKS_LOCK:
            url = Layout(self.info.storage).tracking(self.info.run)
            try:
                known = TrackingLinks.read(url) or TrackingLinks()
            except RecordError as e:  # torn by a crash, or hand-edited: rewritten, never this tracker's failure
                log.warning("%s; written anew", e)
                known = TrackingLinks()
            known.trackers = {**known.trackers, name: links}
            write_json_atomic(url, known.dump())


class Trackers:
    """Rank 0's trackers: ``log(row)`` never blocks; ``close`` waits for each (bounded) and leaves a hung one."""

    def __init__(self, trackers: list[Tracker], info: RunInfo):
        self.lanes = [_Lane(t, info) for t in trackers]

    def log(self, row: MetricsRow) -> None:
        metrics = tracked(row)
        for lane in self.lanes:
            lane.items.put((int(row["step"]), metrics))

    def close(self, status: str, final_model: str | None = None, timeout_s: float = 60.0) -> list[str]:
        """End every tracker's run as ``status`` (``FINISHED`` or ``FAILED``); the names of those that did not end
        in time (still writing, or hung) -- the run does not wait for them beyond ``timeout_s``."""
        for lane in self.lanes:
            lane.close(status, final_model)
        deadline = time.monotonic() + timeout_s
        late = [lane.tracker.name for lane in self.lanes if not lane.closed.wait(max(0.0, deadline - time.monotonic()))]
        for name in late:
            log.warning("tracker %s did not finish within %.0f s; its last points may be missing", name, timeout_s)
        return late
