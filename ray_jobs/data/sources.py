"""Finding and reading source files: a file, a folder of JSONL/Parquet files, or a ``save_to_disk`` folder.

Staging reads a source as a stream of batches (:func:`read_batches`), each ending at a :class:`Position` it can be
restarted from, so memory is one batch whatever the file's size and a killed staging resumes where it was.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ray_jobs.storage import as_url, fs_and_path

_SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")


class StagingError(ValueError):
    """Data that cannot be staged; the message names the file (and line) at fault."""


class SourceUnreadable(StagingError):
    """A source the store did not serve (a transient failure, maybe): not the data's fault."""


def position_unit(url: str) -> str:
    """How a record's position in a source file is counted: JSONL lines, or rows of a columnar file."""
    return "row" if url.endswith((".parquet", ".arrow")) else "line"


@dataclass
class SourceFile:
    url: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def unit(self) -> str:
        return position_unit(self.url)


def list_sources(url: str, field_name: str = "data.train") -> list[str]:
    """The files of a source: the file itself, a ``datasets`` ``save_to_disk`` folder's Arrow files, or every
    JSONL/Parquet file under a folder, sorted."""
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)  # a bucket listing cached earlier in this process may predate new files
    if not fs.exists(path):
        raise StagingError(f"{field_name}: no such file or folder: {url}")
    if fs.isfile(path):
        return [url]
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    if "dataset_dict.json" in names:
        raise StagingError(f"{field_name}: {url} holds several splits (a DatasetDict); point at one, e.g. {url}/train")
    if "state.json" in names:  # a datasets.Dataset.save_to_disk folder: its Arrow files, in order
        with fs.open(f"{path.rstrip('/')}/state.json") as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
        return [f"{url.rstrip('/')}/{name}" for name in files]
    found = sorted(p for p in fs.find(path) if p.endswith(_SOURCE_SUFFIXES))
    if not found:
        raise StagingError(f"{field_name}: folder {url} has no {'/'.join(_SOURCE_SUFFIXES)} files")
    return [as_url(url, p) for p in found]


def read_sources(url: str, field_name: str) -> list[SourceFile]:
    """Every file of a source, read whole (its bytes are hashed into the dataset id)."""
    out = []
    for u in list_sources(url, field_name):
        fs, path = fs_and_path(u)
        try:
            with fs.open(path, "rb") as f:
                out.append(SourceFile(u, f.read()))
        except OSError as e:
            raise StagingError(f"{u}: cannot read: {e}") from e
    return out


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


def read_batches(url: str, start: Position = Position(), batch_bytes: int = 4 << 20) -> Iterator[SourceBatch]:
    """The records of one file from ``start`` on: about ``batch_bytes`` of JSONL, or one record batch of rows."""
    fs, path = fs_and_path(url)
    try:
        with fs.open(path, "rb") as f:
            if position_unit(url) == "line":
                yield from _line_batches(url, f, start, batch_bytes)
            else:
                yield from _row_batches(url, f, start)
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e


def _line_batches(url: str, f, start: Position, batch_bytes: int) -> Iterator[SourceBatch]:
    """Whole lines only: a batch ends at its last newline and the bytes after it open the next batch."""
    f.seek(start.offset)
    offset, lineno, rest = start.offset, start.next, b""
    while True:
        block = f.read(batch_bytes)
        if not block:
            if rest:  # a last line with no newline after it
                yield SourceBatch(url, [(lineno, rest)], Position(offset + len(rest), lineno + 1))
            return
        buf = rest + block
        cut = buf.rfind(b"\n")
        if cut < 0:
            rest = buf
            continue
        lines, rest = buf[:cut].split(b"\n"), buf[cut + 1 :]
        offset += cut + 1
        yield SourceBatch(url, list(enumerate(lines, start=lineno)), Position(offset, lineno + len(lines)))
        lineno += len(lines)


def _row_batches(url: str, f, start: Position) -> Iterator[SourceBatch]:
    """Rows of a Parquet file or an Arrow stream (``save_to_disk``), read a record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = url.endswith(".arrow")
    try:
        batches = pa.ipc.open_stream(f) if arrow else pq.ParquetFile(f).iter_batches(batch_size=8192)
        row = 0
        for batch in batches:
            rows = batch.to_pylist()
            skip = max(0, min(len(rows), start.offset - row))
            row += len(rows)
            if skip < len(rows):
                items = list(enumerate(rows[skip:], start=row - len(rows) + skip + 1))
                yield SourceBatch(url, items, Position(row, row + 1))
    except (pa.ArrowException, ValueError) as e:  # pyarrow raises several types for a damaged file
        raise StagingError(f"{url}: not a readable {'Arrow' if arrow else 'Parquet'} file: {e}") from e
