"""The run registry ``<storage>/runs/<run>/run.json``: state, config, dataset, cluster and every attempt.

Written atomically (whole-file replace), read by ``unbroken status`` and the watchdog.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from ray_jobs.config import Config
from ray_jobs.storage import Layout, read_json, write_json_atomic

STATES = ("submitted", "running", "recovering", "succeeded", "failed")


def submission_id(run: str, attempt: int, kind: str = "train") -> str:
    """Ray job submission id: derived from run name + attempt, so a retried submit is idempotent."""
    return f"unbroken-{run}-{kind}-{attempt:03d}"


def load(storage: str, run: str) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError):
        return read_json(Layout(storage).run_registry(run))
    return None


def save(storage: str, run: str, reg: dict[str, Any]) -> None:
    reg["updated_at"] = time.time()
    write_json_atomic(Layout(storage).run_registry(run), reg)


# Fields a run cannot change between attempts: its checkpoints would not fit (shapes, world size) or resuming
# would silently mix two different trainings. Everything else (max_steps, cadence, cluster address) may change.
FIXED_FIELDS = (
    "model",
    "train.seed",
    "train.micro_batch_size",
    "train.grad_accum_steps",
    "cluster.num_workers",
    "cluster.use_gpu",
)


class RunConflict(ValueError):
    """The run name exists on storage with settings its checkpoints cannot be resumed under."""


def _pick(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def check_compatible(cfg: Config, dataset_id: str) -> None:
    """Refuse to reuse a run name whose earlier attempts used another dataset or a fixed field's other value."""
    reg = load(cfg.storage, cfg.name)
    if reg is None or "config" not in reg:
        return
    new = json.loads(cfg.model_dump_json())
    changed = [
        f"{f}: {_pick(reg['config'], f)!r} -> {_pick(new, f)!r}"
        for f in FIXED_FIELDS
        if _pick(reg["config"], f) != _pick(new, f)
    ]
    if reg.get("dataset_id") not in (None, dataset_id):
        changed.insert(0, f"dataset: {reg['dataset_id']} -> {dataset_id}")
    if changed:
        raise RunConflict(
            f"run {cfg.name!r} already exists at {Layout(cfg.storage).run_dir(cfg.name)} and its checkpoints cannot "
            f"be resumed with this config; use a new name (--set name=...) or remove that run. Changed:\n  "
            + "\n  ".join(changed)
        )


def begin_attempt(cfg: Config, cluster: dict[str, Any], dataset_id: str) -> int:
    """Record a new attempt (state ``submitted``) and return its number (1-based)."""
    reg = load(cfg.storage, cfg.name) or {"name": cfg.name, "created_at": time.time(), "attempts": []}
    attempt = len(reg["attempts"]) + 1
    reg.update(
        state="submitted",
        config=json.loads(cfg.model_dump_json()),
        dataset_id=dataset_id,
        cluster={"address": cluster["address"], "mode": "existing" if cfg.cluster.address else "local"},
    )
    reg["attempts"].append(
        {
            "attempt": attempt,
            "submission_id": submission_id(cfg.name, attempt),
            "started_at": time.time(),
            "status": "SUBMITTED",
        }
    )
    save(cfg.storage, cfg.name, reg)
    return attempt


def end_attempt(cfg: Config, attempt: int, status: str, message: str = "", **extra: Any) -> dict[str, Any]:
    """Record how an attempt ended; the run state follows (succeeded / failed)."""
    reg = load(cfg.storage, cfg.name)
    if reg is None:
        raise FileNotFoundError(Layout(cfg.storage).run_registry(cfg.name))
    entry = reg["attempts"][attempt - 1]
    entry.update(status=status, ended_at=time.time(), message=message)
    reg["state"] = "succeeded" if status == "SUCCEEDED" else "failed"
    reg.update(extra)
    save(cfg.storage, cfg.name, reg)
    return reg
