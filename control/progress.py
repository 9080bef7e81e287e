"""The training's progress as the flow's watch sees it, said where the flow runs: on the terminal of ``unbroken run``
a bar rewritten in place, elsewhere (a served flow, a log file) a line every ``TRAIN_EVERY_S`` -- step of max_steps,
loss, tokens/s, time so far and ETA (ray_jobs/progress.py's Reporter, the same as staging's) -- and each restart
inside the job as it happens, from the job's heartbeat: "a worker failed at step 812: Ray Train restarts the worker
group", then "resumed from step 750 (62 steps to train again)". Read from storage (the metrics log and the heartbeat
the job writes), so it needs no connection to the cluster and costs the watch one more small read a poll.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.progress import Reporter, duration, every_s
from ray_jobs.storage import Layout
from ray_jobs.train.metrics import MetricsTail

TRAIN_EVERY_S = 30.0  # between two progress lines where no terminal shows a bar (UNBROKEN_PROGRESS_S sets it)


@dataclass(frozen=True)
class Stint:
    """One training process's time as the heartbeat's writer: who (pid), from which step, in which phase."""

    pid: int | None
    started_step: int
    step: int
    phase: str

    @classmethod
    def of(cls, beat: Beat) -> Stint:
        return cls(beat.pid, beat.started_step, beat.step, beat.phase or "")


def restart_line(before: Stint | None, now: Stint) -> str | None:
    """What to say when the heartbeat ``now`` shows a restart since ``before`` (None: nothing to say). ``before`` is
    the last stint seen training (or restarting); a training process beats from its start, but says which step it
    resumed from only once it trains, so a stint is judged on its ``training`` beats alone."""
    if before is None:
        return None
    if now.phase == "restarting" and before.phase != "restarting":
        return f"a worker failed at step {before.step}: Ray Train restarts the worker group"
    if now.phase == "training" and (now.pid, now.started_step) != (before.pid, before.started_step):
        lost = max(0, before.step - now.started_step)
        return f"resumed from step {now.started_step} ({lost} step{'s' if lost != 1 else ''} to train again)"
    return None


class TrainingProgress:
    """Polled by the watch: ``poll(beat)`` with the attempt's heartbeat (or None) returns (step, max_steps);
    ``close(done)`` when the watch ends."""

    def __init__(
        self,
        cfg: Config,
        log: logging.Logger | logging.LoggerAdapter,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_steps, self.log, self.stream, self.clock = cfg.train.max_steps, log, stream, clock
        self.metrics = MetricsTail(Layout(cfg.storage).metrics(cfg.name))
        self.began = clock()
        self.stint: Stint | None = None
        self.reporter: Reporter | None = None

    def poll(self, beat: Beat | None) -> tuple[int, int]:
        rows = self.metrics.poll()
        step = int(rows[-1]["step"]) if rows else 0
        if beat is not None and (stint := Stint.of(beat)).phase in ("training", "restarting"):
            if (line := restart_line(self.stint, stint)) is not None:
                self._drop()  # the rate and ETA count again from the resumed step
                self.log.warning(line)
            if self.stint is not None and stint.phase == "restarting":  # the step reached before the failure
                stint = Stint(stint.pid, stint.started_step, max(stint.step, self.stint.step), stint.phase)
            self.stint = stint
        trained = [r for r in rows if "loss" in r]
        restarting = self.stint is not None and self.stint.phase == "restarting"
        if trained and not restarting:  # nothing to show before the first logged step, nor while nothing trains
            r = self._reporter()
            r.note = f"loss {trained[-1]['loss']:.4f}, {duration(self.clock() - self.began)} so far"
            r.update(step, tokens=float(trained[-1].get("tokens_seen", 0)))
        return step, self.max_steps

    def close(self, done: bool) -> None:
        """The watch ended: a last line when the job succeeded, else the bar let go."""
        if done:
            self._finish()
        else:
            self._drop()

    def _reporter(self) -> Reporter:
        if self.reporter is None:
            self.reporter = Reporter(
                "training",
                total=self.max_steps,
                unit="steps",
                rates=("tokens",),
                log=self.log,
                every=every_s() if os.environ.get("UNBROKEN_PROGRESS_S") else TRAIN_EVERY_S,
                stream=self.stream,
                clock=self.clock,
            )
        return self.reporter

    def _finish(self) -> None:
        if self.reporter is not None:
            self.reporter.finish()
            self.reporter = None

    def _drop(self) -> None:
        """Let the bar go without a last line (it would say the work is done)."""
        if self.reporter is not None and self.reporter.tty:
            self.reporter.stream.write("\r\x1b[K")
            self.reporter.stream.flush()
        self.reporter = None
