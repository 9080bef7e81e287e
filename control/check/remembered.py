"""The model probe's answer remembered per model: building a model's module tree on the meta device means importing
torch and transformers (~3 s of a 2-core machine's time, most of a ``check``), yet the answer -- its parameters, its
shape, whether ``model.lora`` fits it -- only changes with the model's ``config.json`` and the model section. A
``check`` run again after fixing the data (the usual loop) reads it back in milliseconds.

Remembered for the built-in models (their section says everything) and local folders (keyed by their config.json's
bytes too); a hub id is probed every time (its config.json is the hub's to change). The file is a cache: a missing,
torn or foreign one is a miss, and ``UNBROKEN_CACHE`` (default ``~/.cache/unbroken``) moves it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from control.check.findings import Finding
from control.check.plan import ModelShape
from ray_jobs.config import Config
from ray_jobs.errors import UserError
from ray_jobs.storage import write_bytes_atomic

VERSION = 1  # of what is remembered: a change of the probe's findings or of ModelShape bumps it


def folder() -> Path:
    return Path(os.environ.get("UNBROKEN_CACHE") or Path.home() / ".cache" / "unbroken") / "model-probes"


def key(cfg: Config) -> str | None:
    """What the probe's answer depends on, hashed; None for a model whose answer is not remembered."""
    from ray_jobs.model.builtin import is_builtin

    m = cfg.model
    parts = [str(VERSION), m.model_dump_json()]
    if not is_builtin(m):
        config = Path(m.name_or_path) / "config.json"
        if not config.is_file():
            return None
        parts.append(hashlib.sha256(config.read_bytes()).hexdigest())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def recall(cfg: Config) -> tuple[list[Finding], ModelShape] | None:
    k = key(cfg)
    if k is None:
        return None
    try:
        saved = json.loads((folder() / f"{k}.json").read_text())
        return [Finding(**f) for f in saved["findings"]], ModelShape(**saved["shape"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember(cfg: Config, found: list[Finding], shape: ModelShape) -> None:
    """Keep the answer (written whole, as every record: ray_jobs/storage.py); a cache that cannot be written is no
    error."""
    k = key(cfg)
    if k is None:
        return
    path = folder() / f"{k}.json"
    body = {"findings": [dataclasses.asdict(f) for f in found], "shape": dataclasses.asdict(shape)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(str(path), json.dumps(body).encode())
    except (OSError, UserError):  # a full or read-only disk: the storage layer's errors are user errors
        pass
