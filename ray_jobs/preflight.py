"""Ray Jobs entrypoint run before training: ``python -m ray_jobs.preflight --spec <url>``.

1. Checks the job can run at all: the cluster has the CPUs/GPUs for ``cluster.num_workers`` workers and the
   dataset has a train shard for every rank, so a job that could never start fails now with a clear message
   instead of pending forever.
2. Warms the node-local shard cache: on every alive node a node-affinity Ray task copies the dataset's shards
   into ``data.cache_dir`` and verifies each checksum. Workers then read locally; a restarted job finds the
   cache warm. (Which node hosts which rank is Ray's choice, so each node gets every shard a rank might read.)
"""

from __future__ import annotations

import argparse
import json
import sys

from ray_jobs.config import from_json
from ray_jobs.data.cache import ShardCache
from ray_jobs.storage import read_json


def check_fit(cfg, total: dict[str, float], manifest: dict) -> list[str]:
    """Everything that would stop the training job from ever starting, as one list of reasons."""
    need_cpu = cfg.cluster.num_workers * cfg.cluster.cpus_per_worker
    problems = []
    shards = len(manifest["shards"]["train"])
    if shards < cfg.cluster.num_workers:
        problems.append(
            f"the dataset has {shards} train shards but cluster.num_workers={cfg.cluster.num_workers}; "
            "raise data.min_shards to at least cluster.num_workers (or lower data.shard_mb)"
        )
    if total.get("CPU", 0) < need_cpu:
        problems.append(
            f"cluster.num_workers={cfg.cluster.num_workers} x cluster.cpus_per_worker={cfg.cluster.cpus_per_worker} "
            f"needs {need_cpu:g} CPUs; the cluster has {total.get('CPU', 0):g}"
        )
    if cfg.cluster.use_gpu and total.get("GPU", 0) < cfg.cluster.num_workers:
        problems.append(
            f"cluster.use_gpu needs {cfg.cluster.num_workers} GPUs; the cluster has {total.get('GPU', 0):g}"
        )
    return problems


def warm_node(storage: str, dataset_id: str, cache_dir: str, max_bytes: float, entries: list[dict]) -> dict:
    import ray

    cache = ShardCache(storage, dataset_id, cache_dir, max_bytes)
    for e in entries:
        cache.local_path(e)
    return {"node": ray.get_runtime_context().get_node_id()[:12], **cache.counters(), "evicted": cache.evicted}


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    parser = argparse.ArgumentParser(prog="ray_jobs.preflight")
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    spec = read_json(args.spec)
    cfg = from_json(json.dumps(spec["config"]))
    manifest = read_json(spec["manifest_url"])
    ray.init()
    problems = check_fit(cfg, ray.cluster_resources(), manifest)
    if problems:
        print("PREFLIGHT FAILED: " + "; ".join(problems), flush=True)
        return 2
    entries = manifest["shards"]["train"] + manifest["shards"]["eval"]
    task = ray.remote(num_cpus=0)(warm_node)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            cfg.storage, manifest["dataset_id"], cfg.data.cache_dir, cfg.data.cache_max_gb * 1e9, entries
        )
        for n in ray.nodes()
        if n["Alive"]
    ]
    for r in ray.get(refs):
        print("PREFLIGHT CACHE " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
