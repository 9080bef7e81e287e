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
    """``cfg`` with what it says in epochs made steps for the staged dataset: ``train.max_steps`` from
    ``train.epochs``, ``train.eval_every_steps`` from ``train.evals_per_epoch``, ``checkpoint.every_steps`` from
    ``checkpoint.saves_per_epoch`` (``cfg`` itself when it says none). The flow resolves it once staged (its progress
    and the run's record show the steps), every rank again from the same manifest: the same numbers."""
    t, c = cfg.train, cfg.checkpoint
    if t.epochs is None and t.evals_per_epoch is None and c.saves_per_epoch is None:
        return cfg
    shards, ranks, per_step = manifest.shards["train"], cfg.cluster.max_workers, t.micro_batch_size * t.grad_accum_steps
    one = epoch_steps(shards, ranks, per_step, 1)
    train = {"max_steps": epoch_steps(shards, ranks, per_step, t.epochs)} if t.epochs is not None else {}
    if t.evals_per_epoch is not None:
        train["eval_every_steps"] = max(1, round(one / t.evals_per_epoch))
    ckpt = {"every_steps": max(1, round(one / c.saves_per_epoch))} if c.saves_per_epoch is not None else {}
    return cfg.model_copy(update={"train": t.model_copy(update=train), "checkpoint": c.model_copy(update=ckpt)})


def steps_problems(raw: dict) -> list[str]:
    """A config as written that sets both ``train.epochs`` and ``train.max_steps`` (a resolved config has both:
    only what a person wrote is judged), or ``train.epochs`` in a search (its rungs are steps)."""
    problems = [
        f"{section}.{per} and {section}.{every}: set one of the two"
        for section, per, every in (
            ("train", "evals_per_epoch", "eval_every_steps"),
            ("checkpoint", "saves_per_epoch", "every_steps"),
        )
        if isinstance(part := raw.get(section), dict) and part.get(per) is not None and every in part
    ]
    train = raw.get("train")
    if not isinstance(train, dict) or train.get("epochs") is None:
        return problems
    if "max_steps" in train:
        return problems + [
            f"train.epochs ({train['epochs']}) and train.max_steps ({train['max_steps']}): set one of the two "
            "(epochs: passes over the data; max_steps: optimizer steps)"
        ]
    if raw.get("tune") is not None:
        return problems + [
            "train.epochs: a search trains every trial to train.max_steps (ASHA's rungs are steps); set that"
        ]
    return problems
