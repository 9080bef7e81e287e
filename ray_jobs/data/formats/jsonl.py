"""JSON Lines (``.jsonl``, and ``.json`` read the same way): byte ranges a worker enters mid-way (a range owns the
lines that begin in it), a line read bounded and checked before parsing (:mod:`ray_jobs.data.lines`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

from ray_jobs.data.formats.base import Position, SourceBatch, SourceFile, Unit
from ray_jobs.data.lines import line_range


class JsonLines:
    name: str = "jsonl"
    suffixes: tuple[str, ...] = (".jsonl", ".json")
    unit: Unit = "line"
    listed: bool = True
    splittable: bool = True

    def batches(
        self, url: str, f: IO[bytes], start: Position, batch_bytes: int, max_chars: int | None
    ) -> Iterator[SourceBatch]:
        """Whole lines only: a batch is the lines that begin in the next ``batch_bytes`` (``start`` begins a line)."""
        at, lineno = start.offset, start.next
        while True:
            items, end = line_range(f, at, at + batch_bytes, max_chars)
            if not items:
                return
            yield SourceBatch(url, [(lineno + n - 1, x) for n, x in items], Position(end, lineno + len(items)))
            at, lineno = end, lineno + len(items)

    def read_range(
        self, url: str, f: IO[bytes], start: int, stop: int | None, max_chars: int | None
    ) -> tuple[list[tuple[int, Any]], int]:
        return line_range(f, start, stop, max_chars)

    def bounds(self, url: str, start: int, size: int, piece_bytes: int) -> list[int]:
        return list(range(start, size, piece_bytes))[1:] if size > start else []

    def rows(self, src: SourceFile) -> list[dict[str, Any]]:
        raise TypeError(f"{src.url}: JSON Lines are read as lines (ray_jobs.data.records), not rows")

    def columns(self, url: str) -> list[str] | None:
        return None  # each record says its own fields (ray_jobs.data.shapes reads the first ones)

    def row_count(self, url: str) -> int | None:
        return None  # progress counts its bytes


READER = JsonLines()
