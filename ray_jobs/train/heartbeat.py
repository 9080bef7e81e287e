"""Rank 0's heartbeat file: liveness and progress, for watchers outside the job."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

from ray_jobs.storage import write_json_atomic


class Heartbeat:
    """Rank 0 refreshes ``runs/<run>/heartbeat.json`` every few seconds from a side thread.

    ``time`` says the process is alive; ``step`` and ``last_step_at`` say whether training moves. A watcher tells a
    hang (fresh ``time``, old ``last_step_at``) from slow progress (``step`` advancing) from a dead process (old
    ``time``).
    """

    def __init__(self, url: str, every_s: float, trainer: Any):
        self.url, self.every_s, self.trainer = url, every_s, trainer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        t = self.trainer
        write_json_atomic(
            self.url,
            {
                "run": t.cfg.name,
                "step": t.loop.step,
                "max_steps": t.cfg.train.max_steps,
                "last_step_at": t.last_step_at,
                "attempt": t.attempt,
                "started_step": t.started_step,
                "first_step_at": t.first_step_at,
                "time": time.time(),
                "tokens_per_s": t.tokens_per_s,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            },
        )

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError):  # a storage hiccup must not kill training
                self.beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.beat()
