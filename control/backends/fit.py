"""Whether a run can start at all, asked before its attempt is recorded or anything is submitted: the staged dataset
has a train shard for every data rank, and the cluster's alive nodes hold the fewest workers the run needs -- waiting
up to ``cluster.start_timeout_s`` for nodes still joining (an autoscaler, a host restarting). A job that could never
start fails here with every reason named, instead of pending forever.

The resources come from the dashboard's node summary (:func:`control.backends.health.read`): one HTTP request, no
Ray job. (A preflight Ray job used to ask ``ray.cluster_resources()`` and warm the node caches: ~8 s a run; the
training job's workers now warm their own shards while their model loads.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from control.backends.base import ClusterError
from control.backends.health import Health
from ray_jobs.config import Config
from ray_jobs.config.tune import concurrency_problem
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.errors import UserError
from ray_jobs.poll import poll_until


class DoesNotFit(ClusterError, UserError):
    """The run cannot start: its dataset cannot feed its workers, or its cluster cannot hold them."""


def data_problems(cfg: Config, manifest: DatasetManifest) -> list[str]:
    """Why the staged dataset cannot feed the run (no wait helps)."""
    c = cfg.cluster
    shards = len(manifest.shards["train"])
    if shards < c.max_workers:  # the data is laid out for max workers (data ranks), whatever the world size
        return [
            f"the dataset has {shards} train shards but cluster.num_workers={c.max_workers}"
            f"{' (its max)' if c.elastic else ''}; raise data.min_shards to at least that (or lower data.shard_mb)"
        ]
    return []


def resources(health: Health) -> dict[str, float]:
    """The alive nodes' CPUs and GPUs (what ``ray.cluster_resources()`` counts)."""
    return {"CPU": sum(n.cpus for n in health.alive), "GPU": sum(n.gpus for n in health.alive)}


def resource_problems(cfg: Config, total: dict[str, float], nothing_joins: bool = False) -> list[str]:
    """Why the cluster's resources cannot hold the fewest workers the run needs. ``nothing_joins``: the cluster is
    this machine's local head, so a GPU short now is short for good -- the problem says what to do instead."""
    c = cfg.cluster
    fewest = cfg.workers[0]  # live recovery's standbys are workers too
    what = f"cluster.num_workers={c.num_workers}" if not c.elastic else f"cluster.num_workers.min={c.min_workers}"
    if fewest > c.min_workers:
        what += f" + fault_tolerance.standby_replicas={fewest - c.min_workers}"
    need_cpu = fewest * c.cpus_per_worker
    problems = []
    if total.get("CPU", 0) < need_cpu:
        problems.append(
            f"{what} x cluster.cpus_per_worker={c.cpus_per_worker} needs {need_cpu:g} CPUs; the cluster has "
            f"{total.get('CPU', 0):g}"
        )
    if cfg.tune is not None and (p := concurrency_problem(cfg, total.get("CPU", 0))):
        problems.append(p)
    if c.use_gpu and total.get("GPU", 0) < fewest:
        fix = "; set cluster.use_gpu=false, or cluster.address to a cluster with GPUs" if nothing_joins else ""
        problems.append(
            f"cluster.use_gpu with {what} needs {fewest} GPUs; the cluster has {total.get('GPU', 0):g}{fix}"
        )
    return problems


def check_fit(cfg: Config, total: dict[str, float], manifest: DatasetManifest) -> list[str]:
    """Everything that would stop the training job from ever starting now, as one list of reasons."""
    return data_problems(cfg, manifest) + resource_problems(cfg, total)


def wait_for_room(
    cfg: Config,
    total: Callable[[], dict[str, float]],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Wait up to ``cluster.start_timeout_s`` for the cluster to hold the fewest workers; the problems left when it
    gives up (none: there is room). ``total``: reads the cluster's resources now."""
    problems: list[str] = []

    def room() -> bool:
        problems[:] = resource_problems(cfg, total())
        return not problems

    poll_until(room, cfg.cluster.start_timeout_s, every_s=2.0, sleep=sleep, clock=clock)
    if problems:
        problems[-1] += f" (waited cluster.start_timeout_s={cfg.cluster.start_timeout_s:g} s)"
    return problems
