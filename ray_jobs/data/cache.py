"""The node-local shard cache: verified copies of a dataset's shards on each node, LRU-evicted by size. Warming a
cold cache (a worker's shards fetched and decoded before its first step) logs its progress when it takes long."""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from pathlib import Path

from ray_jobs.contracts.dataset import Shard
from ray_jobs.model.cache import MODELS_DIR, tree_bytes
from ray_jobs.progress import Reporter, every_s
from ray_jobs.storage import Layout, join, read_bytes

log = logging.getLogger("unbroken.cache")


class ShardIntegrityError(RuntimeError):
    """A shard on storage does not match the checksum its manifest recorded."""


class ShardCache:
    """Verified node-local copies of one dataset's shards; a miss reads shared storage once and fills the cache.

    The cache folder holds one subfolder per dataset. When a new shard would push it past ``max_bytes``, whole
    folders of *other* datasets are evicted, least recently used first; the dataset in use is never evicted, nor the
    node's model cache (``models/``: a rank may be loading from it; its bytes count against ``max_bytes``).
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

    def local_path(self, entry: Shard) -> Path:
        """Path of a verified local copy of a shard, fetching it on a miss."""
        local = self._local(entry)
        if self._is_valid(local, entry):
            self.hits += 1
            return local
        self.misses += 1
        data = read_bytes(join(self.remote_dir, entry.file))
        self.bytes_from_storage += len(data)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ShardIntegrityError(f"{join(self.remote_dir, entry.file)}: sha256 does not match the manifest")
        self._make_room(len(data))
        self._store(local, data, entry.sha256)
        return local

    def rows_paths(self, entries: list[Shard], seq_len: int) -> list[Path]:
        """``rows_path`` of each entry. Those not in the cache yet are fetched and decoded one after the other: once
        that has taken a few seconds, a progress line every few (shards and bytes done, MB/s, ETA)."""
        cold = {id(e) for e in entries if not (self._decoded(e).exists() and self._is_valid(self._local(e), e))}
        total = sum(e.bytes for e in entries if id(e) in cold)
        report = Reporter(f"node cache warm-up of {self.local_dir.name}", total, quiet_s=every_s(), log=log, tty=False)
        if cold:
            report.update(0, shards=0)  # timed from here: the first shard's fetch counts
        out, done, shards = [], 0, 0
        for e in entries:
            out.append(self.rows_path(e, seq_len))
            if id(e) in cold:
                done, shards = done + e.bytes, shards + 1
                report.update(done, shards=shards)
        report.finish()
        return out

    def rows_path(self, entry: Shard, seq_len: int) -> Path:
        """Path of the shard decoded to a raw ``.npy`` (int32 ``[rows, 3, seq_len]``) for memory-mapping; written
        once from the verified Parquet copy, and renamed into place so a half-written one never exists."""
        parquet = self.local_path(entry)
        decoded = self._decoded(entry)
        if not decoded.exists():
            self._make_room(entry.rows * 3 * seq_len * 4)
            tmp = decoded.with_name(f"{decoded.name}.tmp-{uuid.uuid4().hex[:8]}.npy")
            decode_shard(parquet, seq_len, tmp)
            os.replace(tmp, decoded)
        return decoded

    def _local(self, entry: Shard) -> Path:
        return self.local_dir / entry.file

    def _decoded(self, entry: Shard) -> Path:
        local = self._local(entry)
        return local.with_name(f"{local.name}.{entry.sha256[:16]}.npy")

    def _make_room(self, incoming: int) -> None:
        import shutil

        folders = [d for d in self.root.iterdir() if d.is_dir()] if self.root.exists() else []
        used = sum(tree_bytes(d) for d in folders)  # the node's model cache counts against the cap too
        others = [d for d in folders if d != self.local_dir and d.name != MODELS_DIR]  # models: in use, never evicted
        for victim in sorted(others, key=lambda d: d.stat().st_mtime):
            if used + incoming <= self.max_bytes:
                break
            used -= tree_bytes(victim)
            shutil.rmtree(victim, ignore_errors=True)
            self.evicted.append(victim.name)

    @staticmethod
    def _is_valid(local: Path, entry: Shard) -> bool:
        stamp = local.with_name(local.name + ".sha256")
        try:
            return local.stat().st_size == entry.bytes and stamp.read_text() == entry.sha256
        except OSError:
            return False

    @staticmethod
    def _store(local: Path, data: bytes, sha: str) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f"{local.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, local)
        stamp_tmp = local.with_name(f"{local.name}.sha256.tmp-{uuid.uuid4().hex[:8]}")  # unique: ranks race here
        stamp_tmp.write_text(sha)
        os.replace(stamp_tmp, local.with_name(local.name + ".sha256"))  # the stamp last: it vouches for the file

    def counters(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "bytes_from_storage": self.bytes_from_storage}


def decode_shard(parquet_path, seq_len: int, out_path) -> None:
    """Write a Parquet shard's rows to ``out_path`` as one int32 ``.npy`` array ``[rows, 3, seq_len]`` (ids, labels,
    positions), a column of a row group at a time: memory holds one column chunk, not the shard."""
    import numpy as np
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
