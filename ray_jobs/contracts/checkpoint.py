"""``<checkpoint folder>/manifest.json``: what makes a checkpoint exist. Written last by rank 0, once every rank's
files are on storage (ray_jobs/checkpoint/format.py), with the size and sha256 of each; read by every rank choosing
and loading a checkpoint to resume from, and by the watchdog and a search's close (the newest valid checkpoint: what
a restart resumes from and how many steps it trains again)."""

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
