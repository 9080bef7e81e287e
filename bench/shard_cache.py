"""Node shard cache: cold start (every shard fetched from S3 and verified) vs warm start (all local hits).

    .venv/bin/python bench/shard_cache.py [--records 100000]

Stages a generated dataset onto a moto S3 server on loopback (a real HTTP endpoint), then times reading every
shard through ``ShardCache`` with an empty cache and again with the cache filled. A ratio from one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.staging_throughput import make_data  # noqa: E402
from ray_jobs.config import DataConfig  # noqa: E402
from ray_jobs.contracts.dataset import DatasetManifest  # noqa: E402
from ray_jobs.data.reading import ShardCache  # noqa: E402
from ray_jobs.data.staging import stage  # noqa: E402
from ray_jobs.model.builtin import train_char_tokenizer  # noqa: E402
from tests.s3 import make_bucket, moto_server  # noqa: E402


def read_all(storage: str, manifest: DatasetManifest, cache_dir: str) -> tuple[float, dict]:
    started = time.perf_counter()
    cache = ShardCache(storage, manifest.dataset_id, cache_dir)
    for e in manifest.shards["train"] + manifest.shards["eval"]:
        cache.local_path(e)
    return time.perf_counter() - started, cache.counters()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=100_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as d, moto_server():
        src = Path(d) / "data.jsonl"
        make_data(src, args.records)
        storage = make_bucket("bench") + "/store"
        r = stage(
            DataConfig(train=str(src), seq_len=256, shard_mb=2, min_shards=8), train_char_tokenizer(), "b", storage
        )
        cold_s, cold = read_all(storage, r.manifest, f"{d}/cache")
        warm_s, warm = read_all(storage, r.manifest, f"{d}/cache")
    print(json.dumps({"cold_s": round(cold_s, 3), "cold": cold, "warm_s": round(warm_s, 3), "warm": warm}))
    print(
        f"cold start {cold_s * 1000:.0f} ms ({cold['bytes_from_storage'] / 1e6:.1f} MB from S3), "
        f"warm start {warm_s * 1000:.0f} ms (0 bytes) -> {cold_s / warm_s:.0f}x faster"
    )


if __name__ == "__main__":
    main()
