"""``data``: the sources, how records become packed training rows, and where staging and the node cache work."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ray_jobs.config.base import Section


class DataConfig(Section):
    train: str
    """Training source: a JSONL or Parquet file, or a folder of them, as a local path or any fsspec URL (``s3://...``)."""
    eval: str | None = None
    """Optional separate eval source; when empty, ``eval_fraction`` of ``train`` is held out by record hash."""
    format: Literal["pairs", "text", "chat", "alpaca", "sharegpt", "prompt_completion", "preference", "auto"] = "pairs"
    """The records' shape. ``pairs``: prompt/completion fields (``input_field``/``target_field``), tokenized as one
    text, the prompt masked from the loss; ``text``: one text field, all of it learned, a document longer than
    ``seq_len`` cut into pieces; ``chat``: a list of ``{role, content}`` messages rendered with the tokenizer's chat
    template, the assistant turns chosen by ``train_on`` learned. Shapes other tools write: ``alpaca``
    (``instruction``, optional ``input``, ``output``, optional ``system``; a chat when the tokenizer has a template,
    else the Alpaca prompt as ``pairs``), ``sharegpt`` (``conversations: [{from: human|gpt|system, value}]``, as
    ``chat``), ``prompt_completion`` (TRL's ``prompt``/``completion``: strings as ``pairs``, message lists as
    ``chat``), ``preference`` (TRL's ``prompt``/``chosen``/``rejected``: three strings, or three message lists; one
    staged row per record, no packing; trained by DPO, ``train.engine: hf``). ``auto``: the shape is detected from the first records of ``train`` (logged, and part of the dataset
    id)."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """``chat``: learn every assistant turn of a conversation (the default), or only the final one."""
    input_field: str = "input"
    """``pairs``: record field holding the prompt; its tokens are masked from the loss."""
    target_field: str = "target"
    """``pairs``: record field holding the completion the model learns to produce."""
    text_field: str = "text"
    """``text``: record field holding the text."""
    messages_field: str = "messages"
    """``chat``: record field holding the list of messages; the last one must be the assistant's."""
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Share of records held out for eval (chosen by record hash, so adding records never reshuffles)."""
    seq_len: int = Field(256, ge=8)
    """Length in tokens of each packed training sequence."""
    max_record_chars: int | None = Field(None, ge=1)
    """A record longer than this many characters is rejected; unset: 100,000 for prompt/completion and chat records,
    no limit for ``text`` documents (they are cut into pieces, whatever their length)."""
    too_long: Literal["reject", "drop", "truncate"] = "reject"
    """A prompt/completion or chat record longer than ``seq_len`` tokens: ``reject`` it (it counts against
    ``max_reject_fraction``), ``drop`` it (listed in rejects.jsonl and counted in the manifest, not against
    ``max_reject_fraction``), or ``truncate`` it (earlier exchanges of a chat first, then the end of the final reply,
    its end-of-turn marker kept; a record that cannot keep a learned token is dropped). ``text`` documents are never
    too long: they are cut into pieces."""
    text_overlap_tokens: int = Field(0, ge=0)
    """``text``: tokens each piece of a document longer than ``seq_len`` repeats from the end of the piece before, as
    context it is not trained on (every token is learned once). At least the one token before a piece's first
    learned token is always repeated, so 0 and 1 are the same."""
    max_reject_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of bad records tolerated (they go to rejects.jsonl); above it staging fails. 0 = any reject fails."""
    shard_mb: float = Field(256.0, gt=0)
    """Target size of one Parquet shard on storage, in MB."""
    min_shards: int = Field(8, ge=1)
    """Write at least this many train shards, so up to this many ranks each read shards of their own."""
    workers: int = Field(0, ge=0)
    """Processes that validate and tokenize in parallel while staging; 0 = one per CPU core. Staged shards are the
    same for any number."""
    stage_on: Literal["local", "cluster", "auto"] = "auto"
    """Where staging runs: ``local`` (the flow's machine, a process per core), ``cluster`` (a Ray job whose actors
    read and tokenize the sources in parallel on every node; the sources must be readable from the cluster), or
    ``auto``: the cluster once the sources reach ``cluster_stage_mb`` and the cluster can read them (they are on an
    object store, or the cluster is a local head). The shards, manifest and dataset id are the same either way."""
    cluster_stage_mb: float = Field(1024.0, gt=0)
    """``stage_on: auto``: source size in MB from which staging runs on the cluster."""
    verify_sources: bool = False
    """Hash every source file in full on every staging, even when its size and version marker (mtime locally, ETag on
    S3) match what an earlier staging hashed. Off: a restage of unchanged sources reads none of their bytes."""
    work_dir: str = "/tmp/unbroken/staging"
    """Folder on the staging machine for staging's spill and progress files (about the packed size of the dataset
    on disk, never in memory); a killed staging resumes from there."""
    cache_dir: str = "/tmp/unbroken/cache"
    """Node-local folder where each node keeps the shards its ranks read (the same path on every node)."""
    cache_max_gb: float = Field(100.0, gt=0)
    """Size cap of ``cache_dir`` per node, in GB; other datasets' shards are evicted (least recently used first)."""
    allowed_sources: list[str] = []
    """URL or path prefixes a dataset event's ``dataset_uri`` may name (a served deployment trains on whatever an
    event says, so this is its allow-list); empty = the folder holding ``data.train``. Anything else is refused."""

    @model_validator(mode="after")
    def _overlap_fits(self) -> DataConfig:
        if self.text_overlap_tokens > self.seq_len // 2:
            raise ValueError(
                f"data.text_overlap_tokens ({self.text_overlap_tokens}) must be at most half of data.seq_len "
                f"({self.seq_len}): a piece of a long document repeats that much and learns the rest"
            )
        return self
