"""``<checkpoint folder>/manifest.json``: what makes a checkpoint exist. Written last by rank 0, once every rank's
files are on storage (ray_jobs/checkpoint/format.py), with the size and sha256 of each; read by rank 0 choosing the
checkpoint to resume from (its choice, manifest and all, broadcast to every rank), by every rank checking the files it
loads, and by the watchdog's restart (the newest valid checkpoint: what a run resumes from, how many steps a run or a
search's running trials train again)."""

from __future__ import annotations

from typing import ClassVar

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
