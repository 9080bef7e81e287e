"""Source file formats, one module each (a ``READER`` implementing ``base.SourceReader``), and the one table of
them. A new format: a module here and its line in ``READERS``; staging, sharding, shape detection and progress ask
:func:`reader_for` and name no format (tests/unit/test_architecture.py checks the suffixes appear nowhere else)."""

from __future__ import annotations

from ray_jobs.data.formats import arrow, jsonl, parquet
from ray_jobs.data.formats.base import SourceReader

READERS: tuple[SourceReader, ...] = (jsonl.READER, parquet.READER, arrow.READER)


def reader_for(url: str) -> SourceReader:
    """The reader of a file by its name; a name no reader claims is read as JSON Lines (what a single file given
    by path has always been read as)."""
    return next((r for r in READERS if url.endswith(r.suffixes)), jsonl.READER)


def listed_suffixes() -> tuple[str, ...]:
    """The suffixes a folder's listing picks."""
    return tuple(s for r in READERS if r.listed for s in r.suffixes)
