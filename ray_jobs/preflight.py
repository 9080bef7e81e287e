"""Ray Jobs entrypoint run before training: ``python -m ray_jobs.preflight --spec <url>``.

1. Checks the job can run at all: the cluster has the CPUs/GPUs for ``cluster.num_workers`` workers and the
   dataset has a train shard for every rank, so a job that could never start fails now with a clear message
   instead of pending forever.
2. Warms the node-local shard cache with what each node's ranks will read, nothing more: it reserves a placement
   group shaped like the trainer's (``num_workers`` bundles, PACK), reads which node got which bundle, and predicts
   the ranks as Ray Train assigns them (grouped by node, nodes in the order of their first bundle). A node-affinity
   Ray task per node then copies its ranks' train shards (and the eval shards, which every rank slices) into
   ``data.cache_dir``, verifying each checksum. The trainer's own placement group is made later and may land
   otherwise; a rank on an unwarmed node fetches its shards itself on first use, so a wrong guess costs time, never
   correctness. When no placement group can be had in time, every node gets every shard, as before.
"""

from __future__ import annotations

import json
import sys

from ray_jobs.config import job_spec
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import served_shards
from ray_jobs.storage import read_json


def check_fit(cfg, total: dict[str, float], manifest: dict) -> list[str]:
    """Everything that would stop the training job from ever starting, as one list of reasons."""
    return data_problems(cfg, manifest) + resource_problems(cfg, total)


def data_problems(cfg, manifest: dict) -> list[str]:
    """Why the staged dataset cannot feed the run (no wait helps)."""
    c = cfg.cluster
    shards = len(manifest["shards"]["train"])
    if shards < c.max_workers:  # the data is laid out for max workers (data ranks), whatever the world size
        return [
            f"the dataset has {shards} train shards but cluster.num_workers={c.max_workers}"
            f"{' (its max)' if c.elastic else ''}; raise data.min_shards to at least that (or lower data.shard_mb)"
        ]
    return []


def resource_problems(cfg, total: dict[str, float]) -> list[str]:
    """Why the cluster's resources (``ray.cluster_resources()``) cannot hold the fewest workers the run needs."""
    c = cfg.cluster
    fewest = c.min_workers
    what = f"cluster.num_workers={c.num_workers}" if not c.elastic else f"cluster.num_workers.min={fewest}"
    need_cpu = fewest * c.cpus_per_worker
    problems = []
    if total.get("CPU", 0) < need_cpu:
        problems.append(
            f"{what} x cluster.cpus_per_worker={c.cpus_per_worker} needs {need_cpu:g} CPUs; the cluster has "
            f"{total.get('CPU', 0):g}"
        )
    if c.use_gpu and total.get("GPU", 0) < fewest:
        problems.append(f"cluster.use_gpu with {what} needs {fewest} GPUs; the cluster has {total.get('GPU', 0):g}")
    return problems


def workers_that_fit(cfg, total: dict[str, float]) -> int:
    """How many workers the cluster's resources hold now, at most ``cluster.num_workers``' max."""
    c = cfg.cluster
    n = int(total.get("CPU", 0) // c.cpus_per_worker)
    if c.use_gpu:
        n = min(n, int(total.get("GPU", 0)))
    return max(0, min(n, c.max_workers))


def wait_for_room(cfg, resources, sleep=None, clock=None) -> list[str]:
    """Wait up to ``cluster.start_timeout_s`` for the cluster to hold the fewest workers (nodes still joining, an
    autoscaler adding them); the problems left when it gives up (none: there is room). ``resources``: a callable
    returning ``ray.cluster_resources()`` (of alive nodes)."""
    import time

    sleep, clock = sleep or time.sleep, clock or time.monotonic
    deadline = clock() + cfg.cluster.start_timeout_s
    while True:
        problems = resource_problems(cfg, resources())
        if not problems or clock() >= deadline:
            break
        sleep(min(2.0, max(0.0, deadline - clock())))
    if problems:
        problems[-1] += f" (waited cluster.start_timeout_s={cfg.cluster.start_timeout_s:g} s)"
    return problems


def predict_ranks(bundle_nodes: list[str]) -> dict[str, list[int]]:
    """Node -> the world ranks Ray Train gives its workers: grouped by node, nodes in the order of their first bundle
    (``WorkerGroup._assign_worker_ranks`` on CPU; GPU ids only reorder ranks within a node)."""
    out: dict[str, list[int]] = {}
    for node in bundle_nodes:
        out.setdefault(node, [])
    rank = 0
    for node in out:
        n = bundle_nodes.count(node)
        out[node] = list(range(rank, rank + n))
        rank += n
    return out


def node_entries(cfg, manifest: dict, ranks: dict[str, list[int]], world: int) -> dict[str, list[dict]]:
    """The shards each node's ranks read: their train shards (``reading.served_shards``), and every eval shard."""
    train, v, accum = manifest["shards"]["train"], cfg.cluster.max_workers, cfg.train.grad_accum_steps
    return {node: [e for r in rs for e in served_shards(train, v, accum, r, world)] + manifest["shards"]["eval"]
            for node, rs in ranks.items()}  # fmt: skip


def trainer_placement(cfg, world: int, timeout_s: float = 30.0) -> list[str] | None:
    """The node of each bundle of a placement group shaped like the trainer's (``world`` workers), or None if none
    is had in time."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    bundle = {"CPU": cfg.cluster.cpus_per_worker} | ({"GPU": 1} if cfg.cluster.use_gpu else {})
    pg = placement_group([bundle] * world, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        return [nodes[i] for i in range(world)]
    except ray.exceptions.GetTimeoutError:
        return None
    finally:
        remove_placement_group(pg)


def warm_node(
    storage: str, dataset_id: str, cache_dir: str, max_bytes: float, entries: list[dict], seq_len: int
) -> dict:
    """Fetch (and verify) shards into this node's cache and decode each for memory-mapping, as a worker would."""
    import ray

    cache = ShardCache(storage, dataset_id, cache_dir, max_bytes)
    for e in entries:
        cache.rows_path(e, seq_len)
    return {"node": ray.get_runtime_context().get_node_id()[:12], **cache.counters(), "evicted": cache.evicted}


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    spec, cfg = job_spec("ray_jobs.preflight", argv)
    manifest = read_json(spec["manifest_url"])
    ray.init()
    problems = data_problems(cfg, manifest)
    waiting = resource_problems(cfg, ray.cluster_resources())
    if waiting and not problems:  # nodes may still be joining (an autoscaler, a host restarting): wait a while
        print(f"PREFLIGHT WAITING up to {cfg.cluster.start_timeout_s:g} s for room: " + "; ".join(waiting), flush=True)
    problems += wait_for_room(cfg, ray.cluster_resources) if waiting and not problems else waiting
    if problems:
        print("PREFLIGHT FAILED: " + "; ".join(problems), flush=True)
        return 2
    world = workers_that_fit(cfg, ray.cluster_resources())  # what Ray Train will start with (elastic: <= max)
    bundles = trainer_placement(cfg, world)
    if bundles is None:
        everything = manifest["shards"]["train"] + manifest["shards"]["eval"]
        plan = {n["NodeID"]: everything for n in ray.nodes() if n["Alive"]}
        print("PREFLIGHT PLACEMENT unknown (no placement group in time): every node gets every shard", flush=True)
    else:
        ranks = predict_ranks(bundles)
        plan = node_entries(cfg, manifest, ranks, world)
        print("PREFLIGHT PLACEMENT " + json.dumps({n[:12]: r for n, r in ranks.items()}), flush=True)
    task = ray.remote(num_cpus=0)(warm_node)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            cfg.storage,
            manifest["dataset_id"],
            cfg.data.cache_dir,
            cfg.data.cache_max_gb * 1e9,
            entries,
            manifest["seq_len"],
        )
        for node, entries in plan.items()
    ]
    for r in ray.get(refs):
        print("PREFLIGHT CACHE " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
