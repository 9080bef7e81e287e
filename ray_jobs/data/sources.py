"""Finding and reading source files: a file, a folder of JSONL/Parquet files, or a ``save_to_disk`` folder.

Staging cuts each source file into pieces (:func:`pieces`) that a worker reads on its own, wherever it runs: byte
ranges of a JSONL file (a range owns the lines that begin in it), row ranges of a Parquet file (planned from its
footer), or batches the planner reads itself where a file cannot be entered mid-way (an Arrow stream). Each piece
ends at a :class:`Position` staging can be restarted from, so memory is one piece whatever the file's size and a
killed staging resumes where it was.

How a JSONL byte range becomes lines, and a line an object or a reason it is none, is :mod:`ray_jobs.data.lines`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from ray_jobs.data.formats import listed_suffixes, reader_for
from ray_jobs.data.formats.base import (
    Position,
    SourceBatch,
    SourceFile,
    SourceRange,
    SourceUnreadable,
    StagingError,
    Unit,
)
from ray_jobs.storage import as_url, fs_and_path

__all__ = ["Position", "SourceBatch", "SourceFile", "SourceRange", "SourceUnreadable", "StagingError", "list_sources",
           "pieces", "position_unit", "read_batches", "read_range", "read_sources"]  # fmt: skip


FROM_THE_START = Position()


def position_unit(url: str) -> Unit:
    """How a record's position in a source file is counted: lines of a text file, or rows of a columnar one."""
    return reader_for(url).unit


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
    suffixes = listed_suffixes()
    found = sorted(p for p in fs.find(path) if p.endswith(suffixes))
    if not found:
        raise StagingError(f"{field_name}: folder {url} has no {'/'.join(suffixes)} files")
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


def read_batches(
    url: str, start: Position = FROM_THE_START, batch_bytes: int = 4 << 20, max_chars: int | None = None
) -> Iterator[SourceBatch]:
    """The records of one file from ``start`` on: about ``batch_bytes`` of JSONL, or one record batch of rows. A
    JSONL line over ``line_byte_cap(max_chars)`` is a LongLine."""
    fs, path = fs_and_path(url)
    try:
        with fs.open(path, "rb") as f:
            yield from reader_for(url).batches(url, f, start, batch_bytes, max_chars)
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e


def read_range(r: SourceRange, max_chars: int | None = None) -> SourceBatch:
    """The records of a range, numbered from 1; ``end`` is where the next range begins (a byte offset that starts
    a line, or a row) with ``end.next`` one past the last number used. A JSONL line over
    ``line_byte_cap(max_chars)`` is a LongLine, read past without being held."""
    fs, path = fs_and_path(r.url)
    try:
        with fs.open(path, "rb") as f:
            items, end = reader_for(r.url).read_range(r.url, f, r.start, r.stop, max_chars)
    except OSError as e:
        raise SourceUnreadable(f"{r.url}: cannot read: {e}") from e
    return SourceBatch(r.url, items, Position(end, len(items) + 1))


def pieces(url: str, size: int, start: Position, piece_bytes: int) -> Iterator[SourceRange | SourceBatch]:
    """The pieces of one file from ``start`` on, each about ``piece_bytes`` of source; at least one, so even an
    empty file ends (staging records a file as done when its last piece is in)."""
    reader = reader_for(url)
    if not reader.splittable:  # a stream cannot be entered mid-way: read here, a record batch at a time
        got = False
        for batch in read_batches(url, start, piece_bytes):
            got = True
            yield batch
        if not got:
            yield SourceBatch(url, [], start)
        return
    bounds = reader.bounds(url, start.offset, size, piece_bytes)
    edges = [start.offset, *bounds]
    for a, b in zip(edges, [*bounds, None], strict=True):
        yield SourceRange(url, a, b)
