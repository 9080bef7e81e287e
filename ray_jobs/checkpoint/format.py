"""The checkpoint folder format: encode, write (manifest last), verify, list, find the newest valid one, decode."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ray_jobs import faults
from ray_jobs.contracts.base import RecordError
from ray_jobs.contracts.checkpoint import CheckpointManifest, FileMeta, StateDict, StateFile
from ray_jobs.storage import as_url, fs_and_path, join, listing, read_bytes, write_bytes_atomic, write_json_atomic

log = logging.getLogger("unbroken.checkpoint")

# 2: one part per rank (each rank's cursor/RNG; FSDP shards per rank), the manifest written by rank 0 after all.
FORMAT = 2
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.pt"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
_NAME = re.compile(r"checkpoint-step-(\d{8})$")


class CheckpointInvalid(RuntimeError):
    """A checkpoint that must not be loaded; the message says why."""


class StorageUnreachable(OSError):
    """The storage did not answer a checkpoint's read, tries and waits included: nothing is known of the checkpoint
    -- never taken for an invalid one (that would give a run up, or resume it silently from an older checkpoint)."""


# How often a read of a checkpoint's manifest or listing is tried, and the waits between (a blip of an object store,
# an NFS server failing over) before the storage is called unreachable.
READ_WAITS_S = (1.0, 2.0, 4.0)


def _read(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, tried again after each of :data:`READ_WAITS_S` while the storage fails (any OSError but a missing
    file, a timeout); then StorageUnreachable naming ``what``."""
    for wait in (*READ_WAITS_S, None):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except (OSError, TimeoutError) as e:
            if wait is None:
                tried = f"{len(READ_WAITS_S) + 1} tries over {sum(READ_WAITS_S):g} s"
                raise StorageUnreachable(f"{what}: {type(e).__name__}: {e} ({tried})") from e
            log.warning("%s: %s: %s; trying again in %g s", what, type(e).__name__, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-step-{step:08d}"


def checkpoint_step(url: str) -> int:
    """The step a checkpoint folder holds, from its name."""
    m = _NAME.search(url.rstrip("/"))
    if m is None:
        raise ValueError(f"not a checkpoint folder name: {url}")
    return int(m.group(1))


# -- what each rank writes -----------------------------------------------------------------------------------
def rank_file(rank: int) -> str:
    """Rank ``rank``'s own small state: its data cursor and RNG streams."""
    return f"rank-{rank:05d}.json"


def model_part(rank: int) -> str:
    """Rank ``rank``'s shard of the weights (FSDP)."""
    return f"model-rank-{rank:05d}.safetensors"


def optim_part(rank: int) -> str:
    """Rank ``rank``'s shard of the optimizer state (FSDP)."""
    return f"optim-rank-{rank:05d}.pt"


_OWNED = re.compile(r"(?:^|-)rank-(\d{5})\.")


def owner(name: str) -> int | None:
    """The rank a file belongs to, or None for a shared file (read by every rank)."""
    m = _OWNED.search(name)
    return int(m.group(1)) if m else None


@dataclass
class Part:
    """What one rank writes into a checkpoint, already in host memory (so training may go on while it is written):
    file name -> ("safetensors", tensors) | ("torch", object) | ("json", object)."""

    step: int
    files: dict[str, tuple[str, Any]]
    ready: Any = None  # called before the files are read: waits for device-to-host copies still in flight


def encode_file(kind: str, obj: Any) -> bytes:
    if kind == "safetensors":
        from safetensors.torch import save

        return save(obj)
    if kind == "torch":
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    return json.dumps(obj, indent=1).encode()


def write_part(part: Part, url: str) -> dict[str, FileMeta]:
    """Write one rank's files into the checkpoint folder; their size and sha256, computed as they are written."""
    if part.ready is not None:
        part.ready()
    if STATE_FILE in part.files:  # rank 0, first: a folder written again must not keep its old manifest meanwhile
        refuse(url)
    entries = {}
    for name, (kind, obj) in part.files.items():
        data = encode_file(kind, obj)
        write_bytes_atomic(join(url, name), data)
        entries[name] = FileMeta(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        faults.on_checkpoint_file()
    return entries


def write_manifest(
    url: str, step: int, world_size: int, sharded: bool, entries: list[dict[str, FileMeta]]
) -> CheckpointManifest:
    """Rank 0, once every rank's files are on storage: the manifest that makes the checkpoint exist."""
    files = {name: meta for rank_entries in entries for name, meta in rank_entries.items()}
    manifest = CheckpointManifest(
        format=FORMAT,
        step=step,
        written_at=time.time(),
        world_size=world_size,
        sharded=sharded,
        files=dict(sorted(files.items())),
    )
    write_json_atomic(join(url, MANIFEST_FILE), manifest.dump())
    return manifest


# -- verify, read ---------------------------------------------------------------------------------------------
def read_manifest(url: str) -> CheckpointManifest:
    """A checkpoint's manifest; CheckpointInvalid when there is none or it does not read as one, StorageUnreachable
    when the storage does not answer."""
    manifest_url = join(url, MANIFEST_FILE)
    try:
        tree = json.loads(_read(manifest_url, lambda: read_bytes(manifest_url)))
    except FileNotFoundError:
        raise CheckpointInvalid("no manifest.json (the write did not finish)") from None
    except ValueError as e:  # not JSON, not UTF-8: torn or hand-made
        raise CheckpointInvalid(f"manifest.json is unreadable: {e}") from None
    if not isinstance(tree, dict) or tree.get("format") not in (1, FORMAT):
        found = tree.get("format") if isinstance(tree, dict) else tree
        raise CheckpointInvalid(f"unknown checkpoint format {found!r}")
    try:
        return CheckpointManifest.parse(tree, MANIFEST_FILE)
    except RecordError as e:  # a field of the wrong type, one unknown to this release
        raise CheckpointInvalid(str(e)) from None


def check(url: str) -> CheckpointManifest:
    """The manifest, once every file it lists is on storage with the size it records: one listing, no file bytes
    read (a reader still checks each file's sha256 as it loads it). Raises CheckpointInvalid saying why not."""
    manifest = read_manifest(url)
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)
    files = _read(f"{url} (its listing)", lambda: fs.ls(path, detail=True))
    sizes = {p["name"].rstrip("/").rsplit("/", 1)[-1]: p.get("size") for p in files}
    for name, meta in manifest.files.items():
        if name not in sizes:
            raise CheckpointInvalid(f"{name} is missing")
        if sizes[name] != meta.bytes:
            raise CheckpointInvalid(f"{name} is {sizes[name]} bytes, the manifest says {meta.bytes}")
    return manifest


def refuse(url: str) -> None:
    """Take a checkpoint out of consideration: its manifest moves aside (kept, for a person to look at)."""
    fs, path = fs_and_path(join(url, MANIFEST_FILE))
    with contextlib.suppress(FileNotFoundError):
        fs.mv(path, path.removesuffix(".json") + ".refused.json")


def read_files(url: str, manifest: CheckpointManifest, names: list[str]) -> dict[str, bytes]:
    """The named files of a checkpoint, each checked against the manifest's size and sha256."""
    out = {}
    for name in names:
        meta = manifest.files[name]
        try:
            data = read_bytes(join(url, name))
        except FileNotFoundError:
            raise CheckpointInvalid(f"{name} is missing") from None
        if len(data) != meta.bytes:
            raise CheckpointInvalid(f"{name} is {len(data)} bytes, the manifest says {meta.bytes}")
        if hashlib.sha256(data).hexdigest() != meta.sha256:
            raise CheckpointInvalid(f"{name} does not match its sha256 in the manifest")
        out[name] = data
    return out


def rank_files(manifest: CheckpointManifest, rank: int, resharding: bool = False) -> list[str]:
    """What rank ``rank`` loads: the shared files and its own (a format-1 checkpoint is all shared). ``resharding``
    (resuming at another world size): also every rank's shards of weights and optimizer state, to cut its own."""
    shards = (model_part(0).split("-rank-")[0], optim_part(0).split("-rank-")[0])
    return [n for n in manifest.files if owner(n) in (None, rank) or (resharding and n.startswith(shards))]


def read_verified(url: str) -> dict[str, bytes]:
    """Every file of a checkpoint, each checked against the manifest; raises CheckpointInvalid saying why not."""
    manifest = read_manifest(url)
    return read_files(url, manifest, list(manifest.files))


def list_checkpoints(checkpoints_dir: str) -> list[tuple[int, str]]:
    """(step, url) of every checkpoint folder under a run's checkpoint dir, newest first."""
    found = []
    for p in listing(checkpoints_dir):  # afresh: a stale listing would hide the newest checkpoint
        m = _NAME.search(p.rstrip("/"))
        if m:
            found.append((int(m.group(1)), as_url(checkpoints_dir, p)))
    return sorted(found, reverse=True)


def sealed_checkpoints(checkpoints_dir: str, say: bool = True) -> Iterator[tuple[str, CheckpointManifest]]:
    """Newest first, each checkpoint whose manifest lists files all present at their size, as (url, manifest); a
    torn or unreadable one is skipped (said, unless ``say`` is false). Reads manifests and listings only, lazily."""
    for step, url in list_checkpoints(checkpoints_dir):
        try:
            yield url, check(url)
        except CheckpointInvalid as e:
            if say:
                log.warning("skipping checkpoint %s (step %d): %s; trying the previous one", url, step, e)


def find_latest_valid(checkpoints_dir: str) -> tuple[str, CheckpointManifest] | None:
    """The newest sealed checkpoint (:func:`sealed_checkpoints`: older ones are tried in turn), or None."""
    return next(sealed_checkpoints(checkpoints_dir), None)


def decode(files: dict[str, bytes]) -> tuple[StateDict, StateDict, StateFile]:
    """(model state, optimizer state, state.json) of a replicated (not sharded) checkpoint's verified files."""
    import torch
    from safetensors.torch import load

    optim = torch.load(io.BytesIO(files[OPTIM_FILE]), weights_only=True)
    return load(files[MODEL_FILE]), optim, json.loads(files[STATE_FILE])
