"""``datasets/<id>/manifest.json``: what a staged dataset is. Written last by staging (``ray_jobs/data/staging.py``,
in the flow's staging job or local mode), so a crash mid-staging leaves none; read by the flow (the cluster's fit),
the training job's driver, which hands it to every rank (``ray_jobs/job.py``: its JSON form inside Ray Train's loop
config, parsed again by each rank), the shard cache and the scorer of a series' pinned eval set."""

from __future__ import annotations

from typing import ClassVar

from pydantic import JsonValue

from ray_jobs.contracts.base import Part, Record


class Shard(Part):
    """One Parquet shard of a split: its file in the dataset's folder, rows, size and sha256 (checked on caching)."""

    file: str
    rows: int
    bytes: int
    sha256: str


class StagedSource(Part):
    """One source file as staging read it."""

    url: str
    bytes: int
    sha256: str


class TokenizerInfo(Part):
    """The tokenizer the rows were made with: a run whose tokenizer differs is refused (its fingerprint)."""

    name_or_path: str
    fingerprint: str
    vocab_size: int
    pad_token_id: int
    eos_token_id: int | None = None


class Counts(Part):
    """What staging made of the records. A count an older staging did not keep reads as 0."""

    records: int = 0
    rejects: int = 0
    dropped: int = 0
    truncated: int = 0
    documents: int = 0
    pieces: int = 0
    cut_documents: int = 0
    train_examples: int = 0
    eval_examples: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    train_tokens: int = 0
    train_target_tokens: int = 0


class DatasetManifest(Record):
    """A staged dataset: its id, what it was made from and with, what staging counted, and its shards by split."""

    SCHEMA: ClassVar[int] = 1
    dataset_id: str
    staging_version: int
    seq_len: int
    sources: dict[str, list[StagedSource]]
    tokenizer: TokenizerInfo
    # the data config fields that shape the rows (the dataset id's input, ray_jobs/data/staging.staging_config): JSON
    staging_config: dict[str, JsonValue]
    counts: Counts
    shards: dict[str, list[Shard]]  # "train", "eval"

    @property
    def format(self) -> str:
        """The record shape the rows were made from (``data.format``, ``auto`` resolved by staging)."""
        return str(self.staging_config["format"])


def read_manifest(url: str) -> DatasetManifest:
    """The manifest at ``url``; FileNotFoundError when there is none (a dataset not staged, or staged elsewhere),
    RecordError when it does not fit (torn, hand-edited, a newer release's)."""
    found = DatasetManifest.read(url)
    if found is None:
        raise FileNotFoundError(f"{url}: no dataset manifest (the dataset is not staged there)")
    return found
