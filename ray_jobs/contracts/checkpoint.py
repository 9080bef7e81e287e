"""``<checkpoint folder>/manifest.json``: what makes a checkpoint exist. Written last by rank 0, once every rank's
files are on storage (ray_jobs/checkpoint/format.py), with the size and sha256 of each; read by rank 0 choosing the
checkpoint to resume from (its choice, manifest and all, broadcast to every rank), by every rank checking the files it
loads, and by the watchdog's restart (the newest valid checkpoint: what a run resumes from, how many steps a run or a
search's running trials train again)."""

from __future__ import annotations

from typing import Any, ClassVar, NotRequired, TypedDict

from pydantic import JsonValue

from ray_jobs.contracts.base import Part, Record


class FileMeta(Part):
    """One file of the checkpoint as its writer computed it while writing."""

    bytes: int
    sha256: str


class CheckpointManifest(Record):
    """``format`` is the folder's layout (1: one writer, every file shared; 2: one part per rank, ray_jobs/checkpoint/
    format.FORMAT); ``schema_version`` this file's. A format-1 manifest has no world size and is never sharded."""

    SCHEMA: ClassVar[int] = 1
    format: int
    step: int
    written_at: float | None = None
    world_size: int | None = None
    sharded: bool = False
    files: dict[str, FileMeta]


# A torch state dict -- a module's, an optimizer's, a scheduler's, a shard of either: names -> tensors and nested plain
# values. torch types its own so (``state_dict() -> dict[str, Any]``, ``torch.distributed.checkpoint``'s
# ``STATE_DICT_TYPE``): the Any is torch's, named once here.
StateDict = dict[str, Any]


# The checkpoint's JSON files beside its tensors, as TypedDicts: written and read inside one release's training job
# (rank 0 writes, every rank reads), their layout fixed by the manifest's ``format`` -- checked by the type checker,
# not validated again at run time (the manifest's sha256 already says each file is the one written).
class CursorDict(TypedDict):
    """A data rank's place (``ray_jobs/data/reading.Cursor`` as JSON)."""

    epoch: int
    pos: int


class LoopDict(TypedDict):
    """The training loop's counters (``ray_jobs/checkpoint/state.LoopState`` as JSON)."""

    step: int
    tokens_seen: int
    elapsed_s: float
    best_eval_loss: float | None
    world_size: int
    dataset_id: str


class DataPart(TypedDict):
    """How the run's data was laid out: its data ranks, and (since the global cursor) where each of them is."""

    data_ranks: int
    cursors: NotRequired[list[CursorDict]]  # absent in checkpoints from before the global cursor


class RngState(TypedDict):
    """Every RNG stream of a process, JSON-safe (ray_jobs/checkpoint/rng.py takes and sets them)."""

    python: list[Any]  # random.getstate(): [version, the Mersenne Twister's 625 words, a gauss value or None]
    numpy: list[Any]  # the legacy RandomState tuple: [name, 624 words, pos, has_gauss, cached_gaussian]
    torch: list[int]
    cuda: NotRequired[list[int]]


class RankPart(TypedDict):
    """``rank-<r>.json``: what differs between ranks -- where each is in its data, and its RNG streams."""

    cursor: CursorDict
    rng: RngState


class StateFile(TypedDict):
    """``state.json``: everything but tensors that resuming exactly needs."""

    loop: LoopDict
    scheduler: StateDict  # torch's LR scheduler's ``state_dict()``
    last_eval_loss: float | None
    config: dict[str, JsonValue]  # the run's config, credentials masked
    data: NotRequired[DataPart]  # absent in checkpoints from before data ranks: one per worker
    ranks: NotRequired[list[RankPart]]  # format 1 only: every rank's part in this one file
