"""The run's metrics log on storage."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from ray_jobs.storage import is_local, read_bytes, write_bytes_atomic


class MetricsLog:
    """``runs/<run>/metrics.jsonl``, written by rank 0: one JSON line per logged step.

    After a resume, lines past the resumed step are dropped, so the file always describes one consistent run;
    a fresh start (``resumed_step`` None) starts an empty file.
    """

    def __init__(self, url: str, resumed_step: int | None):
        self.url = url
        self.rows: list[dict[str, Any]] = []
        if resumed_step is not None:
            with contextlib.suppress(FileNotFoundError):
                lines = read_bytes(url).decode().splitlines()
                self.rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resumed_step]
        self._rewrite()

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if is_local(self.url):
            with open(self.url, "a") as f:
                f.write(json.dumps(row) + "\n")
        else:  # object stores cannot append: rewrite the whole (small) file
            self._rewrite()

    def _rewrite(self) -> None:
        write_bytes_atomic(self.url, "".join(json.dumps(r) + "\n" for r in self.rows).encode())
