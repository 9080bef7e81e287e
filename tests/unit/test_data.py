"""Worker-side data: deterministic rank shards, a cursor that resumes without reading skipped rows, the cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from ray_jobs.contracts.dataset import Shard
from ray_jobs.data.cache import ShardCache, ShardIntegrityError
from ray_jobs.data.reading import Cursor, RankSampler, rank_shards


def test_take_in_pieces_equals_take_at_once_across_epochs() -> None:
    s = RankSampler(num_rows=10, seed=3, rank=1)
    whole, end = s.take(Cursor(), 27)
    parts, cur = [], Cursor()
    for k in (4, 9, 1, 13):
        idx, cur = s.take(cur, k)
        parts.append(idx)
    assert np.array_equal(np.concatenate(parts), whole)
    assert cur == end == Cursor(epoch=2, pos=7)
    assert sorted(whole[:10]) == list(range(10)), "each epoch is a permutation of all rows"


def test_ranks_and_epochs_get_different_orders() -> None:
    a = RankSampler(50, seed=0, rank=0).permutation(0)
    assert not np.array_equal(a, RankSampler(50, seed=0, rank=1).permutation(0))
    assert not np.array_equal(a, RankSampler(50, seed=0, rank=0).permutation(1))
    assert np.array_equal(a, RankSampler(50, seed=0, rank=0).permutation(0))


def test_resuming_deep_into_an_epoch_builds_only_the_requested_rows() -> None:
    s = RankSampler(num_rows=1_000_000, seed=0, rank=0)
    idx, cur = s.take(Cursor(epoch=0, pos=999_990), 4)
    assert len(idx) == 4 and cur == Cursor(0, 999_994)


def test_shards_are_dealt_round_robin_and_too_few_is_explained() -> None:
    entries = [{"file": f"train-{i}"} for i in range(5)]
    assert [e["file"] for e in rank_shards(entries, 1, 2)] == ["train-1", "train-3"]
    with pytest.raises(ValueError, match="raise data.min_shards"):
        rank_shards(entries[:1], 0, 2)


def _storage_with_shard(tmp_path: Path, payload: bytes) -> tuple[str, Shard]:
    ds = tmp_path / "storage" / "datasets" / "ds-x"
    ds.mkdir(parents=True)
    (ds / "train-00000.parquet").write_bytes(payload)
    entry = Shard(file="train-00000.parquet", rows=1, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return str(tmp_path / "storage"), entry


def test_cache_reads_storage_once_then_serves_locally(tmp_path: Path) -> None:
    storage, entry = _storage_with_shard(tmp_path, b"shard-bytes")
    cold = ShardCache(storage, "ds-x", str(tmp_path / "cache"))
    assert cold.local_path(entry).read_bytes() == b"shard-bytes"
    assert cold.counters() == {"hits": 0, "misses": 1, "bytes_from_storage": 11}
    warm = ShardCache(storage, "ds-x", str(tmp_path / "cache"))
    warm.local_path(entry)
    assert warm.counters() == {"hits": 1, "misses": 0, "bytes_from_storage": 0}


def test_corrupt_local_copy_is_refetched_and_corrupt_storage_is_an_error(tmp_path: Path) -> None:
    storage, entry = _storage_with_shard(tmp_path, b"shard-bytes")
    cache = ShardCache(storage, "ds-x", str(tmp_path / "cache"))
    local = cache.local_path(entry)
    local.write_bytes(b"shard-bytez-and-more")
    assert cache.local_path(entry).read_bytes() == b"shard-bytes"
    assert cache.misses == 2
    bad = entry.model_copy(update={"sha256": "0" * 64})
    with pytest.raises(ShardIntegrityError, match="sha256 does not match"):
        ShardCache(storage, "ds-x", str(tmp_path / "cache2")).local_path(bad)


def test_cache_cap_evicts_other_datasets_least_recently_used_first(tmp_path: Path) -> None:
    import os

    storage = tmp_path / "storage"
    entries = {}
    for ds in ("ds-old", "ds-mid", "ds-new"):
        d = storage / "datasets" / ds
        d.mkdir(parents=True)
        payload = ds.encode() * 100  # 600 bytes
        (d / "train-00000.parquet").write_bytes(payload)
        entries[ds] = Shard(file="train-00000.parquet", rows=1, bytes=len(payload),
                            sha256=hashlib.sha256(payload).hexdigest())  # fmt: skip
    cache_dir = tmp_path / "cache"
    for age, ds in enumerate(("ds-old", "ds-mid")):
        ShardCache(str(storage), ds, str(cache_dir)).local_path(entries[ds])
        os.utime(cache_dir / ds, (1000 + age, 1000 + age))  # ds-old used longest ago

    cache = ShardCache(str(storage), "ds-new", str(cache_dir), max_bytes=1500)
    cache.local_path(entries["ds-new"])
    assert cache.evicted == ["ds-old"], "just enough is evicted, oldest first"
    assert sorted(p.name for p in cache_dir.iterdir()) == ["ds-mid", "ds-new"]

    tiny = ShardCache(str(storage), "ds-new", str(cache_dir), max_bytes=10)
    tiny.local_path(entries["ds-new"].model_copy())  # a hit: nothing fetched, nothing evicted
    assert tiny.evicted == [] and tiny.hits == 1
