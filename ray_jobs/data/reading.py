"""Reading staged shards on a worker: per-rank rows and a resumable cursor.

A worker's rows are memory-mapped, never loaded: the node cache keeps each shard decoded once as a raw int32
``.npy`` beside its Parquet file, and :class:`ShardRows` gathers just the rows a batch asks for from those maps. A
worker's memory is the batch (and an 8-byte permutation entry per row of its own), whatever the dataset's size.

Shards are assigned to ranks deterministically (rank ``r`` of ``w`` reads train shards ``r, r+w, ...``).
The order of a rank's rows in an epoch is a permutation seeded by (seed, rank, epoch), so the position in
the data is fully described by a :class:`Cursor` (epoch, position) and resuming jumps straight to it: no batch
is read or built for the positions that were already consumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_jobs.data.cache import ShardCache


def rank_shards(entries: list[dict[str, Any]], rank: int, world_size: int) -> list[dict[str, Any]]:
    """The train shards rank ``rank`` reads: every ``world_size``-th, starting at its rank."""
    if len(entries) < world_size:
        raise ValueError(
            f"the dataset has {len(entries)} train shards but there are {world_size} workers; "
            f"raise data.min_shards to at least cluster.num_workers (or lower data.shard_mb) and restage"
        )
    return entries[rank::world_size]


class ShardRows:
    """The rows of some shards in order, as one indexable set; ``take`` gathers rows (copying only those)."""

    def __init__(self, parts: list[np.ndarray], seq_len: int):
        self.parts, self.seq_len = parts, seq_len  # each [rows, 3, seq_len] int32, memory-mapped
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, position_ids) int64 arrays ``[len(idx), seq_len]`` of rows ``idx``."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.empty((len(idx), 3, self.seq_len), dtype=np.int32)
        part = np.searchsorted(self.starts, idx, side="right") - 1
        for k in np.unique(part):
            sel = part == k
            out[sel] = self.parts[k][idx[sel] - self.starts[k]]
        wide = out.astype(np.int64)
        return wide[:, 0], wide[:, 1], wide[:, 2]


def open_rows(cache: ShardCache, entries: list[dict[str, Any]], seq_len: int) -> ShardRows:
    """The rows of ``entries`` memory-mapped from the node cache (each shard fetched and decoded on first use).

    Position ids restart at 0 for every packed example; passed to the model, they keep examples from attending
    to each other. Shards from staging version 1 have none: every row then counts 0..seq_len-1, as it was trained.
    """
    return ShardRows([np.load(cache.rows_path(e, seq_len), mmap_mode="r") for e in entries], seq_len)


def load_rows(
    cache: ShardCache, entries: list[dict[str, Any]], seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of ``entries`` in memory as (input_ids, labels, position_ids) int64 arrays (small sets only)."""
    rows = open_rows(cache, entries, seq_len)
    return rows.take(np.arange(len(rows)))


def decode_shard(parquet_path, seq_len: int, out_path) -> None:
    """Write a Parquet shard's rows to ``out_path`` as one int32 ``.npy`` array ``[rows, 3, seq_len]`` (ids, labels,
    positions), a column of a row group at a time: memory holds one column chunk, not the shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(parquet_path, memory_map=True)
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.int32, shape=(pf.metadata.num_rows, 3, seq_len))
    row = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        for k, name in enumerate(("input_ids", "labels", "position_ids")):
            if name in pf.schema_arrow.names:
                column = pf.read_row_group(rg, columns=[name]).column(0).combine_chunks()
                out[row : row + n, k, :] = column.flatten().to_numpy().reshape(-1, seq_len)
            else:  # staging version 1: positions count 0..seq_len-1 in every row
                out[row : row + n, k, :] = np.arange(seq_len, dtype=np.int32)
        row += n
    out.flush()
    del out
    pa.default_memory_pool().release_unused()  # Arrow's allocator keeps freed chunks; a worker should not


@dataclass
class Cursor:
    """Where a rank is in its data: ``pos`` rows into the permutation of ``epoch``."""

    epoch: int = 0
    pos: int = 0


class RankSampler:
    """Deterministic per-epoch order of one rank's rows; ``take`` advances a Cursor without touching skipped rows."""

    def __init__(self, num_rows: int, seed: int, rank: int):
        if num_rows == 0:
            raise ValueError(f"rank {rank} has no training rows")
        self.num_rows = num_rows
        self.seed = seed
        self.rank = rank
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, self.rank, epoch]).permutation(self.num_rows)
            self._epoch = epoch
        return self._perm

    def take(self, cursor: Cursor, k: int) -> tuple[np.ndarray, Cursor]:
        """The next ``k`` row indices from ``cursor`` (wrapping into the next epoch) and the advanced cursor."""
        out: list[np.ndarray] = []
        epoch, pos = cursor.epoch, cursor.pos
        while k > 0:
            perm = self.permutation(epoch)
            chunk = perm[pos : pos + k]
            out.append(chunk)
            k -= len(chunk)
            pos += len(chunk)
            if pos >= self.num_rows:
                epoch, pos = epoch + 1, 0
        return np.concatenate(out), Cursor(epoch, pos)
