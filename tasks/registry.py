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


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _took(a: dict[str, Any]) -> str:
    if not a.get("ended_at"):
        return "running"
    s = int(a["ended_at"] - a["started_at"])
    return f"{s // 60}m{s % 60:02d}s"


def describe(storage: str, run: str) -> str:
    """A human summary of a run from storage alone: state, attempts, incidents, heartbeat, final model."""
    reg = load(storage, run)
    if reg is None:
        raise FileNotFoundError(f"no run {run!r} under {storage} (looked for {Layout(storage).run_registry(run)})")
    cluster = reg.get("cluster", {})
    lines = [
        f"run {run}: {reg.get('state', '?')}",
        f"  dataset: {reg.get('dataset_id', '-')}    cluster: {cluster.get('mode', '-')} {cluster.get('address', '')}",
        "attempts:",
    ]
    for a in reg["attempts"]:
        msg = f"  {a['message'].splitlines()[0][:100]}" if a.get("message") else ""
        lines.append(
            f"  #{a['attempt']} {a['submission_id']}  {a['status']:<9} {_when(a['started_at'])}  {_took(a)}{msg}"
        )
    incidents = reg.get("incidents", [])
    lines.append("incidents:" if incidents else "incidents: none")
    lines += [f"  {_when(i.get('time'))} {i.get('kind')}: {i.get('detail', '')}" for i in incidents]
    lines.append(_heartbeat_line(storage, run))
    if reg.get("final_model"):
        lines.append(f"final model: {reg['final_model']}")
    return "\n".join(lines)


def _heartbeat_line(storage: str, run: str) -> str:
    try:
        beat = read_json(Layout(storage).heartbeat(run))
    except FileNotFoundError:
        return "heartbeat: none yet"
    age = time.time() - beat["last_step_at"]
    return (
        f"heartbeat: step {beat['step']}/{beat['max_steps']}, last step {age:.0f}s ago, {beat['tokens_per_s']} tokens/s"
    )
