"""``train.epochs`` made steps: the optimizer steps of that many passes over a staged dataset's rows.

A staged dataset is laid out for ``cluster.num_workers`` data ranks (its max when elastic): data rank ``v`` owns the
train shards ``v, v+V, ...`` (``ray_jobs/data/reading.py``) and takes ``micro_batch_size x grad_accum_steps`` rows a
step. The data rank with the most rows sets the steps; one with fewer finishes its passes earlier, and its rows past
the last pass are read but masked from the loss (``reading.StepPlan.micro_batch``): every row is trained exactly
``epochs`` times.
"""

from __future__ import annotations

import math

from ray_jobs.config.run import Config
from ray_jobs.contracts.dataset import DatasetManifest, Shard


def data_rank_rows(entries: list[Shard], data_ranks: int) -> list[int]:
    """Training rows of each data rank (its shards ``v, v+V, ...``)."""
    return [sum(e.rows for e in entries[v::data_ranks]) for v in range(data_ranks)]


def epoch_steps(entries: list[Shard], data_ranks: int, rows_per_step: int, epochs: float) -> int:
    """Optimizer steps for ``epochs`` passes when every data rank takes ``rows_per_step`` rows a step."""
    return max(1, math.ceil(epochs * max(data_rank_rows(entries, data_ranks)) / rows_per_step))


def resolve_epochs(cfg: Config, manifest: DatasetManifest) -> Config:
    """``cfg`` with ``train.max_steps`` set from ``train.epochs`` and the staged dataset (``cfg`` itself without
    epochs). The flow resolves it once staged (its progress and the run's record show the steps), every rank again
    from the same manifest: the same number."""
    t = cfg.train
    if t.epochs is None:
        return cfg
    steps = epoch_steps(
        manifest.shards["train"], cfg.cluster.max_workers, t.micro_batch_size * t.grad_accum_steps, t.epochs
    )
    return cfg.model_copy(update={"train": t.model_copy(update={"max_steps": steps})})


def steps_problems(raw: dict) -> list[str]:
    """A config as written that sets both ``train.epochs`` and ``train.max_steps`` (a resolved config has both:
    only what a person wrote is judged), or ``train.epochs`` in a search (its rungs are steps)."""
    train = raw.get("train")
    if not isinstance(train, dict) or train.get("epochs") is None:
        return []
    if "max_steps" in train:
        return [
            f"train.epochs ({train['epochs']}) and train.max_steps ({train['max_steps']}): set one of the two "
            "(epochs: passes over the data; max_steps: optimizer steps)"
        ]
    if raw.get("tune") is not None:
        return ["train.epochs: a search trains every trial to train.max_steps (ASHA's rungs are steps); set that"]
    return []
