"""Eval: the mean loss per target token over a split, each rank reading its own slice, every rank in step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from ray_jobs.config import Config
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import ShardRows, open_rows
from ray_jobs.storage import write_json_atomic

log = logging.getLogger("unbroken.train")

IGNORE_INDEX = -100


class Ranks(Protocol):
    """What eval needs of a runtime (:class:`~ray_jobs.train.runtime.Runtime`, or live recovery's one-slice view):
    which slice of the rows is this rank's, and the sum over ranks."""

    rank: int
    world_size: int

    def all_reduce_sum(self, values: list[float]) -> list[float]: ...


def eval_batches(num_rows: int, world_size: int, micro_batch_size: int, max_batches: int) -> int:
    """Micro-batches every rank runs: enough for the rank with the most rows (capped by ``max_batches`` if set)."""
    per_rank = -(-num_rows // world_size)
    batches = -(-per_rank // micro_batch_size)
    return min(batches, max_batches) if max_batches else batches


def eval_loss(
    model,
    rows: ShardRows,
    rt: Ranks,
    device,
    autocast: Callable[[], AbstractContextManager],
    micro_batch_size: int,
    max_batches: int,
) -> float:
    """Mean loss per target token over ``rows``; each rank reads only its slice of the rows (every
    ``world_size``-th), and all run equally many batches."""
    import torch

    mine = np.arange(rt.rank, len(rows), rt.world_size)
    mb = micro_batch_size
    model.eval()
    loss_sum, count = 0.0, 0
    with torch.no_grad(), autocast():
        for b in range(eval_batches(len(rows), rt.world_size, mb, max_batches)):
            part = _batch_loss(model, rows, mine, b * mb, mb, device)
            if part is not None:
                loss_sum, count = loss_sum + part[0], count + part[1]
    loss_sum, count = rt.all_reduce_sum([loss_sum, float(count)])
    return loss_sum / max(count, 1.0)


def _batch_loss(model, rows: ShardRows, mine: np.ndarray, lo: int, mb: int, device) -> tuple[float, int] | None:
    """(loss x target tokens, target tokens) of this rank's batch at ``lo``; None for a throwaway batch, which a
    rank out of rows runs so that collectives stay in step."""
    import torch

    real = lo < len(mine)
    x, y, p = (
        torch.from_numpy(a).to(device) for a in rows.take(mine[lo : lo + mb] if real else np.arange(min(mb, len(rows))))
    )
    loss = model(input_ids=x, labels=y, position_ids=p, use_cache=False).loss.item()
    if not real:
        return None
    n = int((y[:, 1:] != IGNORE_INDEX).sum())
    return loss * n, n


def series_eval_rows(cfg: Config, manifest: DatasetManifest) -> ShardRows:
    """A series' pinned eval set: another staged dataset's eval split, read through this node's cache."""
    cache = ShardCache(cfg.storage, manifest.dataset_id, cfg.data.cache_dir, cfg.data.cache_max_gb * 1e9)
    return open_rows(cache, manifest.shards["eval"], manifest.seq_len)


def write_score(url: str, dataset_id: str, loss: float, step: int) -> None:
    """``runs/<run>/score.json``, what the promotion gate reads."""
    write_json_atomic(url, {"dataset_id": dataset_id, "eval_loss": loss, "step": step})
    log.info("score on the series' eval set %s: %.4f", dataset_id, loss)
