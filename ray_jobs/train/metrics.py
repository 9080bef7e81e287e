"""The run's metrics log on storage."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

from ray_jobs.storage import is_local, read_bytes, write_bytes_atomic
from ray_jobs.train.sidewrite import SideWriter


class MetricsLog:
    """``runs/<run>/metrics.jsonl``, written by rank 0: one JSON line per logged step.

    After a resume, lines past the resumed step are dropped, so the file always describes one consistent run;
    a fresh start (``resumed_step`` None) starts an empty file. Rows are kept in memory and written from a side
    thread (:class:`SideWriter`): a slow or unavailable store delays the file, never a training step, and the file
    catches up when the store answers again.
    """

    def __init__(self, url: str, resumed_step: int | None):
        self.url = url
        self.rows: list[dict[str, Any]] = []
        if resumed_step is not None:
            with contextlib.suppress(FileNotFoundError):
                lines = read_bytes(url).decode().splitlines()
                self.rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resumed_step]
        self._lock = threading.Lock()
        self._written = 0  # rows[:_written] are on storage
        self._writer = SideWriter(self._write, "unbroken-metrics").start()
        self._rewrite = True  # the first write replaces whatever the file held
        self._writer.poke()

    def append(self, row: dict[str, Any]) -> None:
        with self._lock:
            self.rows.append(row)
        self._writer.poke()

    def flush(self, timeout_s: float = 120.0) -> bool:
        """Wait (bounded) until every row so far is on storage; False if the store did not take them in time."""
        return self._writer.flush(timeout_s)

    def _write(self) -> None:
        with self._lock:
            rows, start = list(self.rows), self._written
        append, self._rewrite = is_local(self.url) and not self._rewrite, True  # a failed append: rewrite next time
        if append:
            with open(self.url, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows[start:]))
        else:  # object stores cannot append: rewrite the whole (small) file
            write_bytes_atomic(self.url, "".join(json.dumps(r) + "\n" for r in rows).encode())
        self._rewrite = False
        self._written = len(rows)
