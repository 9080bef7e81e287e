"""Reading staged shards on a worker: the node-local shard cache, per-rank rows, and a resumable cursor.

Shards are assigned to ranks deterministically (rank ``r`` of ``w`` reads train shards ``r, r+w, ...``).
The order of a rank's rows in an epoch is a permutation seeded by (seed, rank, epoch), so the position in
the data is fully described by a :class:`Cursor` (epoch, position) and resuming jumps straight to it: no batch
is read or built for the positions that were already consumed.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_jobs.storage import Layout, join, read_bytes


class ShardIntegrityError(RuntimeError):
    """A shard on storage does not match the checksum its manifest recorded."""


class ShardCache:
    """Verified node-local copies of one dataset's shards; a miss reads shared storage once and fills the cache.

    The cache folder holds one subfolder per dataset. When a new shard would push it past ``max_bytes``, whole
    folders of *other* datasets are evicted, least recently used first; the dataset in use is never evicted.
    """

    def __init__(self, storage: str, dataset_id: str, cache_dir: str, max_bytes: float = float("inf")):
        self.remote_dir = Layout(storage).dataset_dir(dataset_id)
        self.root = Path(cache_dir)
        self.local_dir = self.root / dataset_id
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.bytes_from_storage = 0
        self.evicted: list[str] = []
        if self.local_dir.exists():
            os.utime(self.local_dir)  # "recently used", for eviction order

    def local_path(self, entry: dict[str, Any]) -> Path:
        """Path of a verified local copy of a shard, fetching it on a miss."""
        local = self.local_dir / entry["file"]
        if self._is_valid(local, entry):
            self.hits += 1
            return local
        self.misses += 1
        data = read_bytes(join(self.remote_dir, entry["file"]))
        self.bytes_from_storage += len(data)
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ShardIntegrityError(f"{join(self.remote_dir, entry['file'])}: sha256 does not match the manifest")
        self._make_room(len(data))
        self._store(local, data, entry["sha256"])
        return local

    def _make_room(self, incoming: int) -> None:
        import shutil

        others = [d for d in self.root.iterdir() if d.is_dir() and d != self.local_dir] if self.root.exists() else []
        used = sum(_tree_bytes(d) for d in [*others, self.local_dir] if d.exists())
        for victim in sorted(others, key=lambda d: d.stat().st_mtime):
            if used + incoming <= self.max_bytes:
                break
            used -= _tree_bytes(victim)
            shutil.rmtree(victim, ignore_errors=True)
            self.evicted.append(victim.name)

    @staticmethod
    def _is_valid(local: Path, entry: dict[str, Any]) -> bool:
        stamp = local.with_name(local.name + ".sha256")
        try:
            return local.stat().st_size == entry["bytes"] and stamp.read_text() == entry["sha256"]
        except OSError:
            return False

    @staticmethod
    def _store(local: Path, data: bytes, sha: str) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f"{local.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, local)
        stamp_tmp = tmp.with_suffix(".stamp")
        stamp_tmp.write_text(sha)
        os.replace(stamp_tmp, local.with_name(local.name + ".sha256"))  # the stamp last: it vouches for the file

    def counters(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "bytes_from_storage": self.bytes_from_storage}


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rank_shards(entries: list[dict[str, Any]], rank: int, world_size: int) -> list[dict[str, Any]]:
    """The train shards rank ``rank`` reads: every ``world_size``-th, starting at its rank."""
    if len(entries) < world_size:
        raise ValueError(
            f"the dataset has {len(entries)} train shards but there are {world_size} workers; "
            f"raise data.min_shards to at least cluster.num_workers (or lower data.shard_mb) and restage"
        )
    return entries[rank::world_size]


def load_rows(cache: ShardCache, entries: list[dict[str, Any]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the rows of some shards into (input_ids, labels) int64 arrays of shape [rows, seq_len]."""
    import pyarrow.parquet as pq

    ids, labels = [], []
    for e in entries:
        table = pq.read_table(cache.local_path(e), memory_map=True)
        ids.append(_column(table, "input_ids", seq_len))
        labels.append(_column(table, "labels", seq_len))
    return np.concatenate(ids), np.concatenate(labels)


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
