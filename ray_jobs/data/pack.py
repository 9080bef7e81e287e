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
from typing import Any, NamedTuple

from ray_jobs.data.tokenize import IGNORE_INDEX
from ray_jobs.storage import join, write_bytes_atomic

COLUMNS = ("input_ids", "labels", "position_ids")


class Rows(NamedTuple):
    """Packed rows, each ``seq_len`` long: token ids, labels, and per-example positions."""

    ids: list[list[int]]
    labels: list[list[int]]
    positions: list[list[int]]


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Rows:
    """Greedy in-order packing into fixed-length rows; an example never straddles two rows."""
    rows = Rows([], [], [])
    cur = Rows([], [], [])
    for ids, labels in examples:
        if len(cur.ids) + len(ids) > seq_len:
            _close_row(rows, cur, seq_len, pad_id)
            cur = Rows([], [], [])
        cur.ids.extend(ids)
        cur.labels.extend([IGNORE_INDEX] + labels[1:])
        cur.positions.extend(range(len(ids)))
    if cur.ids:
        _close_row(rows, cur, seq_len, pad_id)
    return rows


def _close_row(rows: Rows, cur: Rows, seq_len: int, pad_id: int) -> None:
    """Pad the row to ``seq_len``; the padding is a run of its own (positions from 0), never a target."""
    pad = seq_len - len(cur.ids)
    rows.ids.append(cur.ids + [pad_id] * pad)
    rows.labels.append(cur.labels + [IGNORE_INDEX] * pad)
    rows.positions.append(cur.positions + list(range(pad)))


def shard_count(n_rows: int, seq_len: int, shard_mb: float, min_shards: int) -> int:
    bytes_per_row = seq_len * 4 * len(COLUMNS)  # int32 columns
    by_size = math.ceil(n_rows * bytes_per_row / (shard_mb * 1e6))
    return max(1, min(n_rows, max(by_size, min_shards)))


def write_shards(split: str, rows: Rows, n_shards: int, out_dir: str) -> list[dict[str, Any]]:
    """Rows into ``n_shards`` contiguous Parquet shards under ``out_dir``; their manifest entries (with sha256)."""
    bounds = [round(i * len(rows.ids) / n_shards) for i in range(n_shards + 1)]
    entries = []
    for i in range(n_shards):
        lo, hi = bounds[i], bounds[i + 1]
        data = _parquet_bytes([col[lo:hi] for col in rows])
        name = f"{split}-{i:05d}.parquet"
        write_bytes_atomic(join(out_dir, name), data)
        entries.append({"file": name, "rows": hi - lo, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return entries


def _parquet_bytes(columns: list[list[list[int]]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {name: pa.array(col, type=pa.list_(pa.int32())) for name, col in zip(COLUMNS, columns, strict=True)}
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()
