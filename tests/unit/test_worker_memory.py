"""A worker's memory does not grow with the dataset: its rows are memory-mapped, and batches gather just their rows."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from ray_jobs.config import DataConfig
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import open_rows, rank_shards
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import train_char_tokenizer
from tests.conftest import ROOT

SEQ_LEN = 2048

LOAD = """
import json, sys
import numpy as np, psutil
from ray_jobs.contracts.dataset import read_manifest
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import Cursor, RankSampler, open_rows, rank_shards
manifest, storage, cache_dir = read_manifest(sys.argv[1]), sys.argv[2], sys.argv[3]
before = psutil.Process().memory_info().rss
cache = ShardCache(storage, manifest.dataset_id, cache_dir)
train = open_rows(cache, rank_shards(manifest.shards["train"], 0, 2), manifest.seq_len)
evals = open_rows(cache, manifest.shards["eval"], manifest.seq_len)
sampler = RankSampler(len(train), 0, 0)
idx, _ = sampler.take(Cursor(), 8)
batch = train.take(idx)
evals.take(np.arange(0, len(evals), 2)[:8])
print(json.dumps({"grew": psutil.Process().memory_info().rss - before, "rows": len(train) + len(evals)}))
"""


def _stage(tmp: Path, name: str, records: int) -> tuple[DatasetManifest, str]:
    rng = random.Random(records)
    src = tmp / f"{name}.jsonl"
    with src.open("w") as f:
        for i in range(records):  # one record a row: ~2000 characters of the char tokenizer's alphabet
            f.write(json.dumps({"text": f"{i} " + " ".join(str(rng.randrange(10**6)) for _ in range(260))}) + "\n")
    data = DataConfig(train=str(src), format="text", seq_len=SEQ_LEN, min_shards=4, shard_mb=8,
                      eval_fraction=0.1, workers=1, work_dir=str(tmp / "work"))  # fmt: skip
    storage = str(tmp / name)
    return stage(data, train_char_tokenizer(), "builtin", storage).manifest, storage


def _growth(tmp: Path, manifest: DatasetManifest, storage: str) -> dict:
    (tmp / "m.json").write_text(json.dumps(manifest.dump()))
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(tmp / "m.json"), storage, str(tmp / "cache")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_workers_rss_after_loading_a_10x_larger_dataset_grows_by_less_than_50_mb(tmp_path: Path) -> None:
    small = _growth(tmp_path, *_stage(tmp_path, "small", 500))
    large = _growth(tmp_path, *_stage(tmp_path, "large", 5000))
    assert large["rows"] >= 9 * small["rows"]
    in_memory = large["rows"] * 3 * SEQ_LEN * 8 / 2  # what int64 rows in memory took, for half the train rows
    assert in_memory > 50e6, "the large dataset would not have been large in memory: the test would prove nothing"
    print("worker RSS growth after loading:", small, large)
    assert large["grew"] - small["grew"] < 50e6, (small, large)


def test_memory_mapped_rows_are_the_staged_rows(tmp_path: Path) -> None:
    manifest, storage = _stage(tmp_path, "d", 60)
    cache = ShardCache(storage, manifest.dataset_id, str(tmp_path / "cache"))
    entries = rank_shards(manifest.shards["train"], 1, 2)
    rows = open_rows(cache, entries, SEQ_LEN)
    import pyarrow.parquet as pq

    tables = [pq.read_table(Path(storage) / "datasets" / manifest.dataset_id / e.file) for e in entries]
    expect = np.array([r for t in tables for r in t.column("input_ids").to_pylist()])
    idx = np.array([len(rows) - 1, 0, 3, 3, 1])  # any order, repeats, across shards
    ids, labels, positions = rows.take(idx)
    assert ids.dtype == np.int64 and ids.tolist() == expect[idx].tolist()
    assert labels.shape == positions.shape == (5, SEQ_LEN)
