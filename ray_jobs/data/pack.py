"""Packing examples into fixed-length rows, and writing rows as Parquet shards.

Several examples share a row, but none sees another: each example's ``position_ids`` restart at 0, which the model
turns into a block-diagonal causal mask (transformers' ``find_packed_sequence_indices``: a new sequence starts
wherever a position is not the previous one + 1; it applies when no attention mask and no KV cache are passed, so
the trainer passes ``position_ids`` with ``use_cache=False``). And an example's first token is never a target:
nothing in the example precedes it, so the label there would teach the previous example's last token to predict it.
"""

from __future__ import annotations

import hashlib
import io
import math
from typing import NamedTuple, NotRequired, TypedDict

import numpy as np

from ray_jobs.data.tokenize import IGNORE_INDEX, Examples
from ray_jobs.storage import join, write_bytes_atomic

COLUMNS = ("input_ids", "labels", "position_ids")
# What a packer carries from one batch to the next, JSON-safe (staging's progress keeps it to resume): the row being
# filled as [ids, labels, positions] lists.
PackerState = dict[str, list[list[int]]]


class Rows(NamedTuple):
    """Packed rows, each ``seq_len`` long: token ids, labels, and per-example positions."""

    ids: list[list[int]]
    labels: list[list[int]]
    positions: list[list[int]]


def new_rows(lengths: list[int], seq_len: int, fill: int = 0) -> tuple[list[bool], int]:
    """Greedy in-order packing's one decision, per example: whether it opens a new row (it does not fit after the
    ``fill`` tokens of the row being filled, which is closed before it), and the fill of the row left open after the
    last. An example never straddles two rows. :class:`Packer` packs by it; :class:`RowCounter` counts by it."""
    opens = []
    for n in lengths:
        opened = fill + n > seq_len
        opens.append(opened)
        fill = n if opened else fill + n
    return opens, fill


class RowCounter:
    """The rows :class:`Packer` makes of the same examples, counted without building them (``unbroken check``)."""

    def __init__(self, seq_len: int):
        self.seq_len, self.fill, self.rows = seq_len, 0, 0

    def add(self, ex: Examples) -> int:
        """Count a batch of examples; the rows it completed (the last, partly filled row stays open)."""
        opens, self.fill = new_rows(ex.lengths.tolist(), self.seq_len, self.fill)
        closed = sum(opens)
        self.rows += closed
        return closed

    def finish(self) -> int:
        """The open row closed: 1 row, or 0 when it is empty (as :meth:`Packer.finish`)."""
        closed = int(self.fill > 0)
        self.rows, self.fill = self.rows + closed, 0
        return closed


class Packer:
    """Greedy in-order packing into fixed-length rows, fed a batch at a time; an example never straddles two rows.

    Rows come out as int32 arrays ``[rows, 3, seq_len]`` (ids, labels, positions). The row being filled is carried
    from one batch to the next (and in :meth:`state`, so a resumed staging packs exactly as an unbroken one).
    """

    def __init__(self, seq_len: int, pad_id: int, state: PackerState | None = None):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.cur = np.asarray((state or {}).get("row", [[], [], []]), dtype=np.int32).reshape(3, -1)

    def state(self) -> PackerState:
        return {"row": self.cur.tolist()}

    def add(self, ex: Examples) -> np.ndarray:
        """Pack a batch of examples; the rows it completed (the last, partly filled row stays open)."""
        done, fill, starts = [], self.cur.shape[1], np.concatenate([[0], np.cumsum(ex.lengths)])
        row = self._new_row(self.cur)
        lengths = ex.lengths.tolist()
        opens, _ = new_rows(lengths, self.seq_len, fill)
        for i, (n, opened) in enumerate(zip(lengths, opens, strict=True)):
            if opened:
                done.append(self._close(row, fill))
                row, fill = self._new_row(None), 0
            lo, hi = starts[i], starts[i] + n
            row[0, fill : fill + n] = ex.ids[lo:hi]
            row[1, fill : fill + n] = ex.labels[lo:hi]
            row[1, fill] = IGNORE_INDEX  # nothing in the example precedes its first token
            row[2, fill : fill + n] = np.arange(n, dtype=np.int32)
            fill += n
        self.cur = row[:, :fill].copy()
        return np.stack(done) if done else np.empty((0, 3, self.seq_len), dtype=np.int32)

    def finish(self) -> np.ndarray:
        """The open row, padded (no rows when it is empty)."""
        fill = self.cur.shape[1]
        if not fill:
            return np.empty((0, 3, self.seq_len), dtype=np.int32)
        out = self._close(self._new_row(self.cur), fill)[None]
        self.cur = self.cur[:, :0]
        return out

    def _new_row(self, head: np.ndarray | None) -> np.ndarray:
        row = np.empty((3, self.seq_len), dtype=np.int32)
        if head is not None:
            row[:, : head.shape[1]] = head
        return row

    def _close(self, row: np.ndarray, fill: int) -> np.ndarray:
        """Pad the row to ``seq_len``; the padding is a run of its own (positions from 0), never a target."""
        pad = self.seq_len - fill
        row[0, fill:] = self.pad_id
        row[1, fill:] = IGNORE_INDEX
        row[2, fill:] = np.arange(pad, dtype=np.int32)
        return row


class RecordRows:
    """A packer of one row per record (preference pairs, labelled completions): nothing carried from one batch to
    the next, nothing left open at the end. A subclass builds a batch's rows (``add``)."""

    per_example = 1  # sequences a record's example is made of (the staging counts count records)

    def __init__(self, seq_len: int, pad_id: int, state: PackerState | None = None):
        self.seq_len, self.pad_id = seq_len, pad_id

    def state(self) -> PackerState:
        return {}

    def finish(self) -> np.ndarray:
        return np.empty((0, 3, self.seq_len), dtype=np.int32)


class RowPerExample(Packer):
    """One example a row, padded (``data.packing: false``; GRPO's prompts): the rows :class:`Packer` makes when no
    two examples fit together, so a row reads back as one prompt and its completion."""

    def add(self, ex: Examples) -> np.ndarray:
        starts = np.concatenate([[0], np.cumsum(ex.lengths)])
        rows = []
        for i, n in enumerate(ex.lengths.tolist()):
            row = self._new_row(None)
            row[0, :n], row[1, :n] = ex.ids[starts[i] : starts[i] + n], ex.labels[starts[i] : starts[i] + n]
            row[1, 0] = IGNORE_INDEX  # nothing precedes its first token
            row[2, :n] = np.arange(n, dtype=np.int32)
            rows.append(self._close(row, n))
        return np.stack(rows) if rows else np.empty((0, 3, self.seq_len), dtype=np.int32)

    def finish(self) -> np.ndarray:
        return np.empty((0, 3, self.seq_len), dtype=np.int32)


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Rows:
    """All of ``examples`` packed (see :class:`Packer`), as lists."""
    packer = Packer(seq_len, pad_id)
    rows = np.concatenate([packer.add(Examples.of(examples)), packer.finish()]) if examples else np.empty((0, 3, 0))
    return Rows(*(rows[:, k, :].tolist() for k in range(3)))


def shard_count(n_rows: int, seq_len: int, shard_mb: float, min_shards: int) -> int:
    bytes_per_row = seq_len * 4 * len(COLUMNS)  # int32 columns
    by_size = math.ceil(n_rows * bytes_per_row / (shard_mb * 1e6))
    return max(1, min(n_rows, max(by_size, min_shards)))


def shard_bounds(n_rows: int, n_shards: int) -> list[int]:
    """Row boundaries of ``n_shards`` contiguous shards of ``n_rows`` rows: shard ``i`` is rows [b[i], b[i+1])."""
    return [round(i * n_rows / n_shards) for i in range(n_shards + 1)]


class ShardPart(NamedTuple):
    """Consecutive rows of a shard from one source: spill rows ``[lo, hi)`` of each run, in order. ``source``: the
    mixture's source they come from (``data.train[1]``), or None when the split is not a mixture's."""

    source: str | None
    runs: list[tuple[int, int]]

    @property
    def rows(self) -> int:
        return sum(hi - lo for lo, hi in self.runs)


def contiguous_layout(n_rows: int, n_shards: int) -> list[list[ShardPart]]:
    """``n_shards`` shards of consecutive rows (:func:`shard_bounds`): what every split is but a mixture's train."""
    b = shard_bounds(n_rows, n_shards)
    return [[ShardPart(None, [(b[i], b[i + 1])])] for i in range(n_shards)]


class SourceRowsEntry(TypedDict):
    source: str
    rows: int


class ShardEntry(TypedDict):
    """A shard as the manifest lists it (ray_jobs/contracts/dataset.Shard), as staging's progress keeps it too."""

    file: str
    rows: int
    bytes: int
    sha256: str
    sources: NotRequired[list[SourceRowsEntry]]  # a mixture's train shard: its rows by source, in order


def write_shard(split: str, i: int, rows: np.ndarray, out_dir: str, parts: list[ShardPart] | None = None) -> ShardEntry:
    """Rows ``[n, 3, seq_len]`` as Parquet shard ``i`` of ``split`` under ``out_dir``; its manifest entry (with the
    rows of each source, in order, when ``parts`` name sources)."""
    data = parquet_bytes(rows)
    name = f"{split}-{i:05d}.parquet"
    write_bytes_atomic(join(out_dir, name), data)
    out: ShardEntry = {"file": name, "rows": len(rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    named = [p for p in parts or [] if p.source is not None and p.rows]
    if named:
        out["sources"] = [{"source": p.source or "", "rows": p.rows} for p in named]
    return out


def parquet_bytes(rows: np.ndarray) -> bytes:
    """One zstd Parquet file with a ``list<int32>`` column per kind of row content (no per-row Python objects)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, _, seq_len = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * seq_len, seq_len, dtype=np.int32))
    table = pa.table(
        {
            name: pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(rows[:, k, :]).reshape(-1)))
            for k, name in enumerate(COLUMNS)
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()
