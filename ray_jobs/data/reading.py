"""Reading staged shards on a worker: per-rank rows and a resumable cursor.

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


def load_rows(
    cache: ShardCache, entries: list[dict[str, Any]], seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate the rows of some shards into (input_ids, labels, position_ids) int64 arrays [rows, seq_len].

    Position ids restart at 0 for every packed example; passed to the model, they keep examples from attending
    to each other. Shards from staging version 1 have none: every row then counts 0..seq_len-1, as it was trained.
    """
    import pyarrow.parquet as pq

    ids, labels, positions = [], [], []
    for e in entries:
        table = pq.read_table(cache.local_path(e), memory_map=True)
        ids.append(_column(table, "input_ids", seq_len))
        labels.append(_column(table, "labels", seq_len))
        if "position_ids" in table.column_names:
            positions.append(_column(table, "position_ids", seq_len))
        else:
            positions.append(np.broadcast_to(np.arange(seq_len, dtype=np.int64), ids[-1].shape).copy())
    return np.concatenate(ids), np.concatenate(labels), np.concatenate(positions)


def _column(table, name: str, seq_len: int) -> np.ndarray:
    flat = table.column(name).combine_chunks().flatten().to_numpy()
    return flat.reshape(-1, seq_len).astype(np.int64)


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
