"""What a checkpoint holds, how it is written (in the background, manifest last) and how it is trusted.

One checkpoint is one folder ``<storage>/ray/<run>/checkpoint-step-<step>/`` written by rank 0 alone:

    model.safetensors   model weights (full; only the trainable adapter weights for LoRA runs)
    optim.pt            optimizer state (full, also under FSDP), loaded with ``torch.load(weights_only=True)``
    state.json          loop state, LR scheduler, every rank's data cursor and RNG states, the config used
    manifest.json       written last: format, step, sha256 + size of every file above

A folder without a readable manifest, or whose files don't match it, is never loaded: the loader says why and
falls back to the previous valid checkpoint. Nothing is unpickled beyond ``weights_only`` tensors.

The training thread only copies state into host memory (:func:`take_snapshot`); serializing and writing happen
in :class:`AsyncWriter`'s thread, at most one write in flight.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ray_jobs.data import Cursor
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


@dataclass
class LoopState:
    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    best_eval_loss: float | None = None
    world_size: int = 1
    dataset_id: str = ""


@dataclass
class RankState:
    """What differs between ranks: where each is in its data, and its RNG streams."""

    cursor: dict[str, int]
    rng: dict[str, Any]


def unwrap(model):
    return model.module if hasattr(model, "module") else model


# -- RNG state, JSON-safe -------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def rank_state(cursor: Cursor) -> dict[str, Any]:
    return asdict(RankState(cursor=asdict(cursor), rng=rng_state()))


# -- model / optimizer state (DDP or FSDP) --------------------------------------------------------------------
def trainable_names(model) -> set[str]:
    return {n for n, p in unwrap(model).named_parameters() if p.requires_grad}


def model_state(model, fsdp: bool, trainable_only: bool) -> dict[str, Any]:
    """A CPU copy of the weights (complete on rank 0; under FSDP a collective every rank must join)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = {k: v.detach().to("cpu", copy=True) for k, v in unwrap(model).state_dict().items()}
    if trainable_only:
        keep = trainable_names(model)
        sd = {k: v for k, v in sd.items() if k in keep}
    return {k: v.contiguous() for k, v in sd.items()}


def optimizer_state(model, optimizer, fsdp: bool) -> dict[str, Any]:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return _cpu_copy(optimizer.state_dict())


def _cpu_copy(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def load_model_state(model, sd: dict[str, Any], fsdp: bool, trainable_only: bool) -> None:
    expected = trainable_names(model) if trainable_only else None
    if expected is not None and set(sd) != expected:
        raise CheckpointInvalid(f"checkpoint weights {sorted(set(sd) ^ expected)[:5]} do not match the model")
    if fsdp:
        import torch

        params = dict(model.named_parameters())
        missing = set(params) - set(sd) if not trainable_only else set()
        if missing:
            raise CheckpointInvalid(f"checkpoint lacks weights {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, full in sd.items():
                if name in params:
                    params[name].copy_(_local_shard(full, params[name]))
    else:
        unwrap(model).load_state_dict(sd, strict=not trainable_only)


def _local_shard(full, like):
    """This rank's piece of a full tensor, cut locally (every rank holds the full tensor: no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def load_optimizer_state(model, optimizer, osd: dict[str, Any], fsdp: bool) -> None:
    if not fsdp:
        optimizer.load_state_dict(osd)
        return
    # The FSDP optimizer state was saved keyed by parameter name with full tensors; rebuild the optimizer's own
    # (index-keyed, sharded) form locally, moment by moment.
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, osd["param_groups"], strict=True):
        ids = []
        for p in group["params"]:
            saved = osd["state"].get(names[id(p)])
            if saved is not None:
                state[index] = {k: _local_shard(v, p) if k != "step" else v for k, v in saved.items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


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


class AsyncWriter:
    """Writes snapshots on a background thread, one at a time; the trainer learns of completion via ``done()``."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-ckpt")
        self._inflight: tuple[Snapshot, str, Future] | None = None

    def submit(self, snap: Snapshot, url: str) -> None:
        if self._inflight is not None:
            raise RuntimeError("a checkpoint write is already in flight; collect it first")
        self._inflight = (snap, url, self._pool.submit(write, snap, url))

    def done(self) -> bool:
        return self._inflight is not None and self._inflight[2].done()

    def collect(self) -> tuple[Snapshot, str] | None:
        """Wait for the write in flight (if any); returns (snapshot, url) once it is on storage."""
        if self._inflight is None:
            return None
        snap, url, fut = self._inflight
        self._inflight = None
        fut.result()  # re-raise a failed write here, on the training thread
        return snap, url

    def close(self) -> None:
        self._pool.shutdown(wait=True)
