"""How far staging's read of its sources is, for a progress callback: source bytes done of all sources' bytes, with
the spill's counts (records, train tokens).

A JSONL piece ends at a byte offset; a Parquet piece at a row, turned into bytes by the file's share of its rows (its
footer's row count, read once); an Arrow stream counts when it is done. A staging resumed from its spill starts at
the position the spill recorded.
"""

from __future__ import annotations

from collections.abc import Callable

from ray_jobs.data.fingerprint import Source
from ray_jobs.data.formats import reader_for
from ray_jobs.data.sources import Position, position_unit

# progress(done, total, records=..., tokens=...): ray_jobs.progress.Reporter.update fits
ProgressFn = Callable[..., None]


class ReadProgress:
    """Calls ``progress(done_bytes, total_bytes, records=..., tokens=...)`` as pieces come in (unthrottled: the
    callback throttles); does nothing without a callback."""

    def __init__(self, files: list[tuple[str, Source]], progress: ProgressFn | None):
        self.urls = [f.url for _, f in files]
        self.sizes = [f.size for _, f in files]
        self.before = [sum(self.sizes[:i]) for i in range(len(self.sizes) + 1)]
        self.progress = progress
        self._rows: dict[int, int | None] = {}

    @property
    def total(self) -> int:
        return self.before[-1]

    def __call__(self, file_index: int, at: Position, counts: dict[str, int], file_done: bool = False) -> None:
        if self.progress is not None:
            done = self.before[min(file_index + 1 if file_done else file_index, len(self.sizes))]
            if not file_done and file_index < len(self.sizes):
                done += self._within(file_index, at)
            self.progress(done, self.total, records=counts["records"], tokens=counts["train_tokens"])

    def _within(self, i: int, at: Position) -> int:
        """Bytes of file ``i`` before ``at``."""
        if position_unit(self.urls[i]) == "line":
            return min(at.offset, self.sizes[i])
        if i not in self._rows:
            self._rows[i] = reader_for(self.urls[i]).row_count(self.urls[i])
        rows = self._rows[i]
        return int(self.sizes[i] * min(at.offset, rows) / rows) if rows else 0
