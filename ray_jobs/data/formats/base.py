"""What every source file format shares: where reading resumes (:class:`Position`), what a reader hands staging
(:class:`SourceBatch`, :class:`SourceRange`, :class:`SourceFile`), the errors that name a file, and the interface a
format implements (:class:`SourceReader`). A new format is a module of this package with a ``READER``, and one line
in ``ray_jobs.data.formats.READERS``."""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any, Literal, Protocol

from ray_jobs.errors import UserError
from ray_jobs.secrets import MaskedError

Unit = Literal["line", "row"]  # how a record's position is counted: lines of a text file, or rows of a columnar one


class StagingError(MaskedError, UserError, ValueError):
    """Data that cannot be staged; the message names the file (and line) at fault, masked: it is shown in logs, a
    flow run's state and a staging job's outcome, and a source URL may carry credentials."""


class SourceUnreadable(StagingError):
    """A source the store did not serve (a transient failure, maybe): not the data's fault."""

    users_fault = False


@contextmanager
def readable(url: str, kind: str) -> Generator[None]:
    """pyarrow's errors for a damaged ``kind`` file (Parquet, Arrow) as one StagingError naming it: pyarrow raises
    several types."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, ValueError) as e:
        raise StagingError(f"{url}: not a readable {kind} file: {e}") from e


@dataclass(frozen=True)
class Position:
    """Where to resume reading a file: ``offset`` bytes (JSONL) or rows (columnar) in, next record number ``next``."""

    offset: int = 0
    next: int = 1


@dataclass
class SourceBatch:
    """Consecutive records of one file: ``(line, raw bytes)`` for JSONL, ``(row, dict)`` for Parquet/Arrow."""

    url: str
    items: list[tuple[int, Any]]
    end: Position


@dataclass(frozen=True)
class SourceRange:
    """A piece of one file a worker reads itself: the lines that begin at bytes [start, stop) of a JSONL file, or
    rows [start, stop) of a Parquet file; ``stop`` None: to the end. Its records are numbered from 1 (a worker
    cannot know how many lines came before ``start``); staging adds the count before it to every reject."""

    url: str
    start: int
    stop: int | None


@dataclass
class SourceFile:
    url: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class SourceReader(Protocol):
    """One file format. ``suffixes``: the file names it reads; ``listed``: whether a folder's listing picks its files
    (a ``save_to_disk`` folder's Arrow files are named by its state.json instead); ``splittable``: whether a worker
    can enter a file mid-way (:meth:`read_range` from a :meth:`bounds` cut), else the planner reads it in batches."""

    name: str
    suffixes: tuple[str, ...]
    unit: Unit
    listed: bool
    splittable: bool

    def batches(
        self, url: str, f: IO[bytes], start: Position, batch_bytes: int, max_chars: int | None
    ) -> Iterator[SourceBatch]:
        """The records from ``start`` on, about ``batch_bytes`` of source (or one record batch of rows) at a time."""
        ...

    def read_range(
        self, url: str, f: IO[bytes], start: int, stop: int | None, max_chars: int | None
    ) -> tuple[list[tuple[int, Any]], int]:
        """The records of [start, stop), numbered from 1, and where the next range begins."""
        ...

    def bounds(self, url: str, start: int, size: int, piece_bytes: int) -> list[int]:
        """Where pieces after ``start`` begin, about ``piece_bytes`` of source each."""
        ...

    def rows(self, src: SourceFile) -> list[dict[str, Any]]:
        """Every row of a columnar file held whole (``unit == "row"``; a text format's lines are parsed by records)."""
        ...

    def columns(self, url: str) -> list[str] | None:
        """Its column names without reading rows, or None when only records can tell (a text format's)."""
        ...

    def row_count(self, url: str) -> int | None:
        """How many rows it holds, from metadata alone (progress), or None when it cannot say so cheaply."""
        ...


def row_batches(url: str, batches: Any, start: Position) -> Iterator[SourceBatch]:
    """Rows of pyarrow record ``batches`` from row ``start.offset`` on, numbered from 1 (Parquet and Arrow alike)."""
    row = 0
    for batch in batches:
        rows = batch.to_pylist()
        skip = max(0, min(len(rows), start.offset - row))
        row += len(rows)
        if skip < len(rows):
            items = list(enumerate(rows[skip:], start=row - len(rows) + skip + 1))
            yield SourceBatch(url, items, Position(row, row + 1))
