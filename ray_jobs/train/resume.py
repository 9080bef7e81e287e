"""Resume: which checkpoint a start resumes from, and the trainer's state to and from a checkpoint's files.

One decision per start, made once by rank 0 and broadcast (:func:`agreed_choice`): if each rank picked its own
"newest valid", one slow or throttled read could send one rank to an older checkpoint, and the ranks would diverge
or deadlock. The choice reads manifests only; each rank then reads and verifies the shared files and its own part.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ray_jobs import checkpoint as ckpt
from ray_jobs.checkpoint import LoopState
from ray_jobs.config import Config
from ray_jobs.contracts.checkpoint import CheckpointManifest, CursorDict, RankPart, StateFile
from ray_jobs.data.reading import Cursor
from ray_jobs.train.runtime import Runtime

log = logging.getLogger("unbroken.train")


def choose_resume(
    checkpoints_dir: str, explicit: str | None, check=None, refused: Sequence[str] = ()
) -> tuple[str | None, str, CheckpointManifest | None]:
    """Which checkpoint this start resumes from: (url or None, why, its manifest). Reads manifests and one listing
    per checkpoint (``ckpt.check``), no tensor bytes; ``refused``: checkpoints a rank already failed to load.

    The explicit checkpoint (what the watchdog names for its attempt) is a floor, not a pin: the newest valid
    checkpoint at or after its step. On the attempt's first start that is the explicit one itself (the watchdog
    picked the newest); after Ray Train restarts the worker group inside the job it is a newer one -- an in-job
    restart never rewinds past the newest valid checkpoint, and never needs the explicit one to still exist
    (retention deletes it once ``num_to_keep`` newer ones are reported). An explicit checkpoint that is invalid
    with nothing valid after it is an error, not a silent step back. Without one: the newest valid, or none."""
    check = check or ckpt.check
    if explicit in refused:  # a rank read it and found it bad: the newest valid one is older, step back to it
        explicit = None
    floor = ckpt.checkpoint_step(explicit) if explicit else None
    for step, url in ckpt.list_checkpoints(checkpoints_dir):
        if floor is not None and step < floor:
            break
        try:
            if url in refused:
                raise ckpt.CheckpointInvalid("a rank could not load its part")
            manifest = check(url)
        except ckpt.CheckpointInvalid as e:
            log.warning("skipping checkpoint %s (step %d): %s", url, step, e)
            continue
        if explicit is None:
            return url, "the newest valid checkpoint", manifest
        same = url.rstrip("/") == explicit.rstrip("/")
        return url, "the checkpoint named for this attempt" if same else f"newer than {explicit}", manifest
    return _explicit_elsewhere(explicit, check)


def _explicit_elsewhere(explicit: str | None, check) -> tuple[str | None, str, CheckpointManifest | None]:
    """Nothing valid listed at or after the explicit checkpoint: the explicit one read where it is, or none."""
    if explicit is None:
        return None, "no valid checkpoint", None
    try:  # not under this run's checkpoint folder (or listed late): read it where it is
        return explicit, "the checkpoint named for this attempt", check(explicit)
    except ckpt.CheckpointInvalid as e:
        raise ckpt.CheckpointInvalid(
            f"the checkpoint named to resume from, {explicit}, is not valid ({e}) and no valid checkpoint is newer"
        ) from None


def agreed_choice(
    rt: Runtime, checkpoints_dir: str, explicit: str | None, refused: list[str]
) -> tuple[str | None, str, CheckpointManifest | None]:
    """Rank 0's :func:`choose_resume`, broadcast: the same (url, why, manifest) on every rank, or the same error."""
    choice: tuple[str | None, str, CheckpointManifest | None] = (None, "", None)
    if rt.rank == 0:
        try:
            choice = choose_resume(checkpoints_dir, explicit, refused=refused)
        except ckpt.CheckpointInvalid as e:
            choice = (None, f"error: {e}", None)
        except ckpt.StorageUnreachable as e:  # a storage error, never an invalid checkpoint: the job fails as such
            choice = (None, f"storage: {e}", None)
        except Exception as e:  # every rank must hear of it, or the others wait in the broadcast
            choice = (None, f"failed: {type(e).__name__}: {e}", None)
    url, reason, manifest = rt.broadcast_object(choice)
    if reason.startswith("error: "):
        raise ckpt.CheckpointInvalid(reason.removeprefix("error: "))
    if reason.startswith("storage: "):
        raise ckpt.StorageUnreachable(reason.removeprefix("storage: "))
    if reason.startswith("failed: "):
        raise RuntimeError(f"choosing a checkpoint to resume from {reason}")
    return url, reason, manifest


def resume_agreed(
    rt: Runtime, checkpoints_dir: str, explicit: str | None, load: Callable[[str, CheckpointManifest], bool]
) -> tuple[str | None, str]:
    """The checkpoint every rank resumed from, and why (None: start fresh). ``load`` reads and loads one on every
    rank, False when some rank found its part bad: then every rank falls back to the previous one together, and the
    bad one is refused so that no later start (nor the watchdog) picks it again."""
    refused: list[str] = []
    while True:
        url, reason, manifest = agreed_choice(rt, checkpoints_dir, explicit, refused)
        if url is None:
            return url, reason
        assert manifest is not None, "choose_resume returns a checkpoint with the manifest it checked"
        if load(url, manifest):
            return url, reason
        log.warning("checkpoint %s: a rank found its part bad; every rank falls back to the previous one", url)
        if rt.rank == 0:
            ckpt.refuse(url)
        refused.append(url)


def together(rt: Runtime, failed: str) -> None:
    """Raise on every rank if ``failed`` (a message) is set on any (a collective every rank enters)."""
    if rt.all_reduce_sum([float(bool(failed))])[0] > 0:
        reasons = [r for r in rt.all_gather_object(failed) if r]
        raise RuntimeError("; ".join(reasons))


def read_part(rt: Runtime, url: str, manifest: CheckpointManifest) -> tuple[dict[str, bytes] | None, float, str]:
    """This rank's files of a checkpoint, verified: (files, 1.0 when one was bad, why reading failed otherwise)."""
    try:
        names = ckpt.rank_files(manifest, rt.rank, manifest.world_size != rt.world_size)
        return ckpt.read_files(url, manifest, names), 0.0, ""
    except ckpt.CheckpointInvalid as e:
        log.warning("rank %d: checkpoint %s: %s", rt.rank, url, e)
        return None, 1.0, ""
    except Exception as e:
        return None, 0.0, f"rank {rt.rank} could not read checkpoint {url}: {type(e).__name__}: {e}"


def check_resumable(
    state: StateFile, manifest: CheckpointManifest, data_ranks: int, world_size: int, fsdp: bool
) -> None:
    """Refuse (``CheckpointInvalid``) a checkpoint this run cannot resume exactly: another data layout, a world
    size it cannot be resharded to, another parallelism."""
    loop = LoopState(**state["loop"])
    data = state.get("data") or {"data_ranks": loop.world_size}  # older checkpoints: one data rank per worker
    if data["data_ranks"] != data_ranks:
        raise ckpt.CheckpointInvalid(
            f"its data is laid out for {data['data_ranks']} workers, this run's for {data_ranks}; "
            f"resume with cluster.num_workers (its max, if elastic) = {data['data_ranks']}"
        )
    if "cursors" not in data and loop.world_size != world_size:
        raise ckpt.CheckpointInvalid(
            f"written by {loop.world_size} workers before checkpoints held a global data cursor; resume it with "
            f"{loop.world_size} workers"
        )
    if manifest.sharded != fsdp and manifest.format > 1:
        raise ckpt.CheckpointInvalid(
            f"written with train.parallelism={'fsdp' if manifest.sharded else 'ddp'}; resume with the same"
        )


def rank_part(files: dict[str, bytes], state: StateFile, manifest: CheckpointManifest, rank: int) -> RankPart | None:
    """This rank's own state (RNG streams, its data rank's cursor), or None for a rank the checkpoint's smaller
    world did not have: its RNG streams start from the seed."""
    if manifest.format == 1:
        return state["ranks"][rank]
    if ckpt.rank_file(rank) in files:
        return json.loads(files[ckpt.rank_file(rank)])
    return None


@dataclass
class Restored:
    """What a checkpoint gave back besides the tensors, loaded in place."""

    loop: LoopState
    cursors: list[Cursor] | None  # the global data cursor, one per data rank (None: gathered from the ranks)
    last_eval: float | None


def load_checkpoint(
    rt: Runtime, cfg: Config, url: str, manifest: CheckpointManifest, model, optimizer, scheduler, data_ranks: int
) -> tuple[Restored | None, int]:
    """Read, verify and load this rank's part of a checkpoint, every rank deciding together (collectives), and the
    bytes this rank read. None when some rank found its part bad (all fall back); an error that is not the
    checkpoint's fault (a read that failed, a checkpoint that does not fit this run) fails every rank, never a
    silent step back."""
    files, bad, failed = read_part(rt, url, manifest)
    read = sum(len(d) for d in files.values()) if files is not None else 0
    together(rt, failed)
    if rt.all_reduce_sum([bad])[0] > 0:
        return None, read
    assert files is not None, "a rank that read none set bad or failed, and every rank returned or raised above"
    restored, own_cursor = None, None
    try:
        restored, own_cursor = restore(rt, cfg, files, manifest, model, optimizer, scheduler, data_ranks)
    except Exception as e:
        failed = f"rank {rt.rank} could not load checkpoint {url}: {type(e).__name__}: {e}"
    together(rt, failed)
    assert restored is not None, "restore returned, or its failure was raised on every rank by together()"
    if restored.cursors is None:  # a checkpoint from before the global cursor: each rank held its own
        restored.cursors = [Cursor(**c) for c in rt.all_gather_object(own_cursor)]
    return restored, read


def restore(
    rt: Runtime,
    cfg: Config,
    files: dict[str, bytes],
    manifest: CheckpointManifest,
    model,
    optimizer,
    scheduler,
    data_ranks: int,
) -> tuple[Restored, CursorDict | None]:
    """Load a checkpoint's verified files into this rank's model, optimizer and scheduler; the rest of its state,
    and this rank's own cursor when the checkpoint predates the global one (its ``cursors`` then None)."""
    fsdp = cfg.train.parallelism == "fsdp"
    state: StateFile = json.loads(files[ckpt.STATE_FILE])
    check_resumable(state, manifest, data_ranks, rt.world_size, fsdp)
    loop = LoopState(**state["loop"])
    ckpt.load_tensor_files(
        model, optimizer, files, manifest, loop.world_size, rt.rank, rt.world_size, fsdp, cfg.model.lora is not None
    )
    scheduler.load_state_dict(state["scheduler"])
    mine = rank_part(files, state, manifest, rt.rank)
    data = state.get("data") or {}
    cursors = [Cursor(**c) for c in data["cursors"]] if "cursors" in data else None
    if mine is not None:
        ckpt.set_rng_state(mine["rng"])
    own = None
    if cursors is None:  # a checkpoint from before the global cursor: check_resumable kept the world size, so
        assert mine is not None, "every rank of an unchanged world has its part"
        own = mine["cursor"]
    return Restored(loop, cursors, state.get("last_eval_loss")), own
