"""Finding and reading source files: a file, a folder of JSONL/Parquet files, or a ``save_to_disk`` folder.

Staging cuts each source file into pieces (:func:`pieces`) that a worker reads on its own, wherever it runs: byte
ranges of a JSONL file (a range owns the lines that begin in it), row ranges of a Parquet file (planned from its
footer), or batches the planner reads itself where a file cannot be entered mid-way (an Arrow stream). Each piece
ends at a :class:`Position` staging can be restarted from, so memory is one piece whatever the file's size and a
killed staging resumes where it was.

How a JSONL byte range becomes lines, and a line an object or a reason it is none, is :mod:`ray_jobs.data.lines`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ray_jobs.data.lines import line_range
from ray_jobs.errors import UserError
from ray_jobs.secrets import MaskedError
from ray_jobs.storage import as_url, fs_and_path

_SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")


class StagingError(MaskedError, UserError, ValueError):
    """Data that cannot be staged; the message names the file (and line) at fault, masked: it is shown in logs, a
    flow run's state and a staging job's outcome, and a source URL may carry credentials."""


class SourceUnreadable(StagingError):
    """A source the store did not serve (a transient failure, maybe): not the data's fault."""

    users_fault = False


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
        return [f"{url.rstrip('/')}/{name}" for name in _state_files(fs, path, url)]
    found = sorted(p for p in fs.find(path) if p.endswith(_SOURCE_SUFFIXES))
    if not found:
        raise StagingError(f"{field_name}: folder {url} has no {'/'.join(_SOURCE_SUFFIXES)} files")
    return [as_url(url, p) for p in found]


def _state_files(fs, path: str, url: str) -> list[str]:
    """The file names a ``save_to_disk`` folder's ``state.json`` lists, each a plain name inside the folder: one
    that climbs out (``..``), is absolute or names a protocol (``s3://``, ``C:``) is refused, never read."""
    where = f"{url.rstrip('/')}/state.json"
    try:
        with fs.open(f"{path.rstrip('/')}/state.json") as f:
            names = [d["filename"] for d in json.load(f)["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not datasets' shape of it
        raise StagingError(f"{where}: not a datasets state.json (expected _data_files[].filename): {e!r}") from e
    for name in names:
        if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or {".", ".."} & set(name.split("/")):
            raise StagingError(f"{where}: _data_files entry {name!r} is not a file inside the folder; refused")
    return names


_PLAIN_NAME = re.compile(r"[^/\\:]+(?:/[^/\\:]+)*")  # relative, no empty part, no backslash, no protocol or drive


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


def read_batches(url: str, start: Position = Position(), batch_bytes: int = 4 << 20,
                 max_chars: int | None = None) -> Iterator[SourceBatch]:  # fmt: skip
    """The records of one file from ``start`` on: about ``batch_bytes`` of JSONL, or one record batch of rows. A
    JSONL line over ``line_byte_cap(max_chars)`` is a LongLine."""
    fs, path = fs_and_path(url)
    try:
        with fs.open(path, "rb") as f:
            if position_unit(url) == "line":
                yield from _line_batches(url, f, start, batch_bytes, max_chars)
            else:
                yield from _row_batches(url, f, start)
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e


def _line_batches(url: str, f, start: Position, batch_bytes: int, max_chars: int | None) -> Iterator[SourceBatch]:
    """Whole lines only: a batch is the lines that begin in the next ``batch_bytes`` (``start`` begins a line)."""
    at, lineno = start.offset, start.next
    while True:
        items, end = line_range(f, at, at + batch_bytes, max_chars)
        if not items:
            return
        yield SourceBatch(url, [(lineno + n - 1, x) for n, x in items], Position(end, lineno + len(items)))
        at, lineno = end, lineno + len(items)


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


@dataclass(frozen=True)
class SourceRange:
    """A piece of one file a worker reads itself: the lines that begin at bytes [start, stop) of a JSONL file, or
    rows [start, stop) of a Parquet file; ``stop`` None: to the end. Its records are numbered from 1 (a worker
    cannot know how many lines came before ``start``); staging adds the count before it to every reject."""

    url: str
    start: int
    stop: int | None


def read_range(r: SourceRange, max_chars: int | None = None) -> SourceBatch:
    """The records of a range, numbered from 1; ``end`` is where the next range begins (a byte offset that starts
    a line, or a row) with ``end.next`` one past the last number used. A JSONL line over
    ``line_byte_cap(max_chars)`` is a LongLine, read past without being held."""
    fs, path = fs_and_path(r.url)
    try:
        with fs.open(path, "rb") as f:
            if position_unit(r.url) == "line":
                items, end = line_range(f, r.start, r.stop, max_chars)
            else:
                items, end = _parquet_range(r.url, f, r.start, r.stop)
    except OSError as e:
        raise SourceUnreadable(f"{r.url}: cannot read: {e}") from e
    return SourceBatch(r.url, items, Position(end, len(items) + 1))


def _parquet_range(url: str, f, start: int, stop: int | None) -> tuple[list[tuple[int, dict]], int]:
    """Rows [start, stop) of a Parquet file, decoding only the row groups they lie in."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
        total = pf.metadata.num_rows
        stop = total if stop is None else min(stop, total)
        groups, first, row = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if row + n > start and row < stop:
                groups.append(g)
                first = row if first is None else first
            row += n
        rows: list[dict] = []
        row = first or 0
        for batch in pf.iter_batches(batch_size=8192, row_groups=groups) if groups else ():
            lo, hi = max(start - row, 0), min(stop - row, batch.num_rows)
            if lo < hi:
                rows.extend(batch.slice(lo, hi - lo).to_pylist())
            row += batch.num_rows
    except (pa.ArrowException, ValueError) as e:  # pyarrow raises several types for a damaged file
        raise StagingError(f"{url}: not a readable Parquet file: {e}") from e
    return list(enumerate(rows, start=1)), max(stop, start)


def pieces(url: str, size: int, start: Position, piece_bytes: int) -> Iterator[SourceRange | SourceBatch]:
    """The pieces of one file from ``start`` on, each about ``piece_bytes`` of source; at least one, so even an
    empty file ends (staging records a file as done when its last piece is in)."""
    if url.endswith(".arrow"):  # a stream cannot be entered mid-way: read here, a record batch at a time
        got = False
        for batch in read_batches(url, start, piece_bytes):
            got = True
            yield batch
        if not got:
            yield SourceBatch(url, [], start)
        return
    bounds = _row_bounds(url, start.offset, piece_bytes) if position_unit(url) == "row" else None
    if bounds is None:
        bounds = list(range(start.offset, size, piece_bytes))[1:] if size > start.offset else []
    edges = [start.offset, *bounds]
    for a, b in zip(edges, [*bounds, None], strict=True):
        yield SourceRange(url, a, b)


def _row_bounds(url: str, start: int, piece_bytes: int) -> list[int]:
    """Row numbers after ``start`` where pieces of a Parquet file begin: small row groups together, big ones cut,
    about ``piece_bytes`` (uncompressed) each, from the file's footer alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = fs_and_path(url)
    try:
        with fs.open(path, "rb") as f:
            md = pq.ParquetFile(f).metadata
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e
    except (pa.ArrowException, ValueError) as e:
        raise StagingError(f"{url}: not a readable Parquet file: {e}") from e
    cuts, row, held = [], 0, 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        per_row = rg.total_byte_size / max(rg.num_rows, 1)
        r = 0
        while r < rg.num_rows:
            take = min(rg.num_rows - r, max(1, int((piece_bytes - held) / per_row)) if per_row else rg.num_rows)
            r += take
            held += take * per_row
            if held >= piece_bytes:
                cuts.append(row + r)
                held = 0
        row += rg.num_rows
    return [c for c in cuts if start < c < row]
