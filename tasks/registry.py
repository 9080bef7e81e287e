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
