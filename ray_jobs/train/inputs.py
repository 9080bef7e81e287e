"""What a rank reads: its node's shard cache, and the train split's rows laid out as steps (a ``StepPlan``)."""

from __future__ import annotations

from ray_jobs.config import Config
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import StepPlan


def shard_cache(cfg: Config, manifest: DatasetManifest) -> ShardCache:
    """The node cache of the dataset's shards (``data.cache_dir``, at most ``data.cache_max_gb``)."""
    return ShardCache(cfg.storage, manifest.dataset_id, cfg.data.cache_dir, cfg.data.cache_max_gb * 1e9)


def train_plan(cfg: Config, manifest: DatasetManifest, cache: ShardCache, rank: int, world_size: int) -> StepPlan:
    """The train split's steps for ``rank`` of ``world_size``. Laid out for cluster.num_workers' max whatever the world
    size now (reading.StepPlan): rows memory-mapped, read as batches take them. Position ids restart per packed
    example: with them (and no KV cache) the model attends within examples only."""
    t = cfg.train
    return StepPlan(
        cache,
        manifest.shards["train"],
        manifest.seq_len,
        data_ranks=cfg.cluster.max_workers,
        grad_accum_steps=t.grad_accum_steps,
        micro_batch_size=t.micro_batch_size,
        seed=t.seed,
        rank=rank,
        world_size=world_size,
        epochs=t.epochs,
        pad_id=manifest.tokenizer.pad_token_id,
    )
