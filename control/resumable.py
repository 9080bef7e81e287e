"""Whether a run can resume under a new config: the fields its checkpoints fix (``FIXED_FIELDS``), compared between
the config its record holds and the one it is started with; ``RunConflict`` when one changed. Pure: the record is
read by control/registry.py (``check_compatible``)."""

from __future__ import annotations

import json
from typing import Any

from ray_jobs.config import Config, without_later_defaults
from ray_jobs.errors import UserError
from ray_jobs.secrets import mask_tree
from ray_jobs.storage import Layout

__all__ = ["FIXED_FIELDS", "RunConflict", "check_resumable", "pick"]

# Fields a run cannot change between attempts: its checkpoints would not fit (shapes, the data layout) or resuming
# would silently mix two different trainings. Everything else (max_steps, cadence, cluster address) may change,
# including the world size within the same max: ``cluster.num_workers`` is compared by its max (the data ranks).
FIXED_FIELDS = (
    "model",
    "train.seed",
    "train.micro_batch_size",
    "train.grad_accum_steps",
    "cluster.num_workers",
    "cluster.use_gpu",
)


class RunConflict(UserError, ValueError):
    """The run name exists on storage with settings its checkpoints cannot be resumed under."""


def pick(tree: object, dotted: str) -> object:
    """The value at ``dotted`` in a config tree (``{}`` where it has none)."""
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    if dotted == "cluster.num_workers" and isinstance(tree, dict) and "max" in tree:
        return tree["max"]  # {min, max}: the data is laid out for max
    return tree


def check_resumable(recorded: dict[str, Any], recorded_dataset: str | None, cfg: Config, dataset_id: str) -> None:
    """RunConflict when ``cfg`` and ``dataset_id`` change what the run's record holds (``recorded``: its config as
    run.json holds it, ``recorded_dataset``: its dataset) in a way its checkpoints cannot be resumed under."""
    # as run.json holds it (masked); a field added since the run was recorded counts at its default
    old, new = without_later_defaults(recorded), without_later_defaults(mask_tree(json.loads(cfg.model_dump_json())))
    changed = [f"{f}: {pick(old, f)!r} -> {pick(new, f)!r}" for f in FIXED_FIELDS if pick(old, f) != pick(new, f)]
    if recorded_dataset not in (None, dataset_id):
        changed.insert(0, f"dataset: {recorded_dataset} -> {dataset_id}")
    if changed:
        raise RunConflict(
            f"run {cfg.name!r} already exists at {Layout(cfg.storage).run_dir(cfg.name)} and its checkpoints cannot "
            f"be resumed with this config; use a new name (--set name=...) or remove that run. Changed:\n  "
            + "\n  ".join(changed)
        )
