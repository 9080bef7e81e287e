"""``datasets/<id>/manifest.json``: what a staged dataset is. Written last by staging (``ray_jobs/data/staging.py``,
in the flow's staging job or local mode), so a crash mid-staging leaves none; read by the flow (the cluster's fit),
the training job's driver, which hands it to every rank (``ray_jobs/job.py``: its JSON form inside Ray Train's loop
config, parsed again by each rank), the shard cache and the scorer of a series' pinned eval set."""

from __future__ import annotations

from typing import ClassVar

from pydantic import JsonValue

from ray_jobs.contracts.base import Part, Record


class ShardSource(Part):
    """Consecutive rows of a mixture's train shard that come from one of its sources."""

    source: str  # the config field that named it: data.train[1]
    rows: int


class Shard(Part):
    """One Parquet shard of a split: its file in the dataset's folder, rows, size and sha256 (checked on caching);
    for a mixture's train shard, its rows by source, in order (unset otherwise, and in manifests from before)."""

    file: str
    rows: int
    bytes: int
    sha256: str
    sources: list[ShardSource] = []

    def source_of(self, row: int) -> str | None:
        """The mixture's source row ``row`` of this shard comes from; None when the shard names none."""
        end = 0
        for part in self.sources:
            end += part.rows
            if row < end:
                return part.source
        return None


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


class MixedSource(Part):
    """One source of a mixture (``data.train`` a list) as staging made it: its records, the train rows they packed
    into, and the rows staged after its weight -- ``staged_rows / rows`` is how often each row repeats (below 1: a
    share of them, chosen by a stable hash)."""

    source: str  # the config field: data.train[1]
    where: str  # its path, or hub:owner/name (split=...)
    weight: float
    format: str
    files: int
    records: int
    rejects: int
    rows: int
    staged_rows: int

    @property
    def repeats(self) -> float:
        return self.staged_rows / self.rows if self.rows else 0.0


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
    mixture: list[MixedSource] = []  # data.train's sources when it names several (their rows in each train shard)

    @property
    def format(self) -> str:
        """The record shape the rows were made from (``data.format``, ``auto`` resolved by staging)."""
        return str(self.staging_config["format"])

    def source_of(self, file: str, row: int) -> str | None:
        """The mixture's source a train row comes from, by shard file and row in it (what a row trace names); None
        when the dataset is not a mixture's."""
        shard = next((s for s in self.shards.get("train", []) if s.file == file), None)
        return None if shard is None else shard.source_of(row)


def read_manifest(url: str) -> DatasetManifest:
    """The manifest at ``url``; FileNotFoundError when there is none (a dataset not staged, or staged elsewhere),
    RecordError when it does not fit (torn, hand-edited, a newer release's)."""
    found = DatasetManifest.read(url)
    if found is None:
        raise FileNotFoundError(f"{url}: no dataset manifest (the dataset is not staged there)")
    return found
