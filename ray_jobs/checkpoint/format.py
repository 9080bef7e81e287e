"""The checkpoint folder format: encode, write (manifest last), verify, list, find the newest valid one, decode."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from ray_jobs.storage import as_url, fs_and_path, join, read_bytes, write_bytes_atomic, write_json_atomic

log = logging.getLogger("unbroken.checkpoint")

FORMAT = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.pt"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
_NAME = re.compile(r"checkpoint-step-(\d{8})$")


class CheckpointInvalid(RuntimeError):
    """A checkpoint that must not be loaded; the message says why."""


def checkpoint_name(step: int) -> str:
    return f"checkpoint-step-{step:08d}"


def checkpoint_step(url: str) -> int:
    """The step a checkpoint folder holds, from its name."""
    m = _NAME.search(url.rstrip("/"))
    if m is None:
        raise ValueError(f"not a checkpoint folder name: {url}")
    return int(m.group(1))


# -- snapshot, write, verify, read ----------------------------------------------------------------------------
@dataclass
class Snapshot:
    """Everything one checkpoint holds, already in host memory (so training may go on while it is written)."""

    step: int
    model: dict[str, Any]
    optim: dict[str, Any]
    state: dict[str, Any]


def encode(snap: Snapshot) -> dict[str, bytes]:
    import torch
    from safetensors.torch import save

    buf = io.BytesIO()
    torch.save(snap.optim, buf)
    return {
        MODEL_FILE: save(snap.model),
        OPTIM_FILE: buf.getvalue(),
        STATE_FILE: json.dumps(snap.state, indent=1).encode(),
    }


def write(snap: Snapshot, url: str) -> dict[str, Any]:
    """Write a checkpoint folder; ``manifest.json`` goes last, so a partial folder is never taken as valid."""
    files = encode(snap)
    for name, data in files.items():
        write_bytes_atomic(join(url, name), data)
    manifest = {
        "format": FORMAT,
        "step": snap.step,
        "written_at": time.time(),
        "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()},
    }
    write_json_atomic(join(url, MANIFEST_FILE), manifest)
    return manifest


def read_verified(url: str) -> dict[str, bytes]:
    """Every file of a checkpoint, each checked against the manifest; raises CheckpointInvalid saying why not."""
    try:
        manifest = json.loads(read_bytes(join(url, MANIFEST_FILE)))
    except FileNotFoundError:
        raise CheckpointInvalid("no manifest.json (the write did not finish)") from None
    except (ValueError, OSError) as e:
        raise CheckpointInvalid(f"manifest.json is unreadable: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointInvalid(f"unknown checkpoint format {manifest.get('format')!r}")
    out = {}
    for name, meta in manifest["files"].items():
        try:
            data = read_bytes(join(url, name))
        except FileNotFoundError:
            raise CheckpointInvalid(f"{name} is missing") from None
        if len(data) != meta["bytes"]:
            raise CheckpointInvalid(f"{name} is {len(data)} bytes, the manifest says {meta['bytes']}")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise CheckpointInvalid(f"{name} does not match its sha256 in the manifest")
        out[name] = data
    return out


def list_checkpoints(checkpoints_dir: str) -> list[tuple[int, str]]:
    """(step, url) of every checkpoint folder under a run's checkpoint dir, newest first."""
    fs, path = fs_and_path(checkpoints_dir)
    fs.invalidate_cache(path)  # s3fs caches listings; a stale one would hide the newest checkpoint
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    found = []
    for p in entries:
        m = _NAME.search(p.rstrip("/"))
        if m:
            found.append((int(m.group(1)), as_url(checkpoints_dir, p)))
    return sorted(found, reverse=True)


def find_latest_valid(checkpoints_dir: str) -> tuple[str, dict[str, bytes]] | None:
    """The newest checkpoint whose files all match its manifest (older ones are tried in turn), or None."""
    for step, url in list_checkpoints(checkpoints_dir):
        try:
            return url, read_verified(url)
        except CheckpointInvalid as e:
            log.warning("skipping checkpoint %s (step %d): %s; trying the previous one", url, step, e)
    return None


def decode(files: dict[str, bytes]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state, state.json) of verified checkpoint files."""
    import torch
    from safetensors.torch import load

    optim = torch.load(io.BytesIO(files[OPTIM_FILE]), weights_only=True)
    return load(files[MODEL_FILE]), optim, json.loads(files[STATE_FILE])
