"""``data``: the sources, how records become packed training rows, and where staging and the node cache work."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from ray_jobs.config.base import Section

# record_formats.FORMATS' names (tests/unit/test_record_formats.py holds them equal): the literal validates a config,
# types it, and lists the choices in the reference
Format = Literal[
    "pairs", "text", "chat", "alpaca", "sharegpt", "prompt_completion", "preference", "unpaired_preference", "auto"
]
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # owner/name, or a bare name
_SPLIT = re.compile(r"\w[\w.-]*")  # a split's name: no slicing (``train[:10%]``), which would stage the whole split


class TrainSource(Section):
    """One source of a ``data.train`` list: a file or folder (``path``), or a hub dataset (``hub``)."""

    path: str | None = None
    """A JSONL or Parquet file, a folder of them, or a ``save_to_disk`` folder, as a local path (relative to where
    the config is loaded) or any fsspec URL: what a plain ``data.train`` string names."""
    hub: str | None = None
    """A Hugging Face hub dataset id, ``owner/name``, read through the ``datasets`` library and its cache
    (``HF_HOME``/``HF_DATASETS_CACHE``; with ``HF_HUB_OFFLINE=1``, or when the hub does not answer, from the cache
    alone). Its split is written once as a Parquet file under ``data.work_dir`` and staged as any file, so the
    dataset id follows its rows: a new revision with other rows is a new dataset."""
    split: str = "train"
    """``hub``: the split to train on (a name; a slice such as ``train[:10%]`` is refused)."""
    subset: str | None = None
    """``hub``: the dataset's configuration (``load_dataset``'s ``name``), when it has several."""
    revision: str | None = None
    """``hub``: a branch, tag or commit; unset, the default branch (when the hub cannot be reached: the newest cached
    copy)."""
    weight: float = Field(1.0, gt=0)
    """This source's share of the training rows, relative to the others' weights (see ``data.train``)."""
    format: Format | None = None
    """This source's record shape (``data.format``'s values); unset, ``data.format``."""

    @model_validator(mode="after")
    def _one_place(self) -> TrainSource:
        if (self.path is None) == (self.hub is None):
            raise ValueError("give exactly one of path (a file, folder or URL) and hub (a hub dataset id)")
        if self.hub is None and (self.split != "train" or self.subset or self.revision):
            raise ValueError("split, subset and revision are for a hub dataset (hub: owner/name)")
        if self.hub is not None and not _HUB_ID.fullmatch(self.hub):
            raise ValueError(f"hub: {self.hub!r} is not a hub dataset id (owner/name)")
        if not _SPLIT.fullmatch(self.split):
            raise ValueError(f"split: {self.split!r} is not a split's name (a slice is not supported)")
        if not math.isfinite(self.weight):
            raise ValueError("weight: must be a finite number")
        return self

    @property
    def where(self) -> str:
        """The source as a person names it: its path, or ``hub:owner/name`` with what is not the default."""
        if self.path is not None:
            return self.path
        extra = [f"{k}={v}" for k, v in (("subset", self.subset), ("revision", self.revision)) if v]
        return f"hub:{self.hub} ({', '.join([f'split={self.split}', *extra])})"


class DataConfig(Section):
    train: str | list[TrainSource]
    """Training source: a JSONL or Parquet file, or a folder of them, as a local path or any fsspec URL
    (``s3://...``). A hub dataset: ``{hub: owner/name, split: train, subset: null, revision: null}`` (read through
    the ``datasets`` library and its cache; offline, from the cache alone). A mixture: a list of sources, each a
    mapping with ``path`` or ``hub``, an optional ``weight`` (default 1) and ``format`` (default ``data.format``),
    e.g. ``[{path: a.jsonl, weight: 3}, {hub: owner/name, weight: 1, format: chat}]``. The weights are shares of the
    training rows: each source's records are packed into rows of their own (a row never holds two sources), the
    heaviest source's rows are staged once and every other source's are repeated or subsampled (whole rows, chosen
    by a stable hash) to ``weight / heaviest weight`` times as many; the manifest counts each source's rows and how
    often they repeat. Each source gives ``eval_fraction`` of its records to the eval split, unweighted (or
    ``data.eval`` is the eval split)."""
    eval: str | None = None
    """Optional separate eval source; when empty, ``eval_fraction`` of ``train`` is held out by record hash."""
    format: Format = "pairs"
    """The records' shape. ``pairs``: prompt/completion fields (``input_field``/``target_field``), tokenized as one
    text, the prompt masked from the loss; ``text``: one text field, all of it learned, a document longer than
    ``seq_len`` cut into pieces; ``chat``: a list of ``{role, content}`` messages rendered with the tokenizer's chat
    template, the assistant turns chosen by ``train_on`` learned. Shapes other tools write: ``alpaca``
    (``instruction``, optional ``input``, ``output``, optional ``system``; a chat when the tokenizer has a template,
    else the Alpaca prompt as ``pairs``), ``sharegpt`` (``conversations: [{from: human|gpt|system, value}]``, as
    ``chat``), ``prompt_completion`` (TRL's ``prompt``/``completion``: strings as ``pairs``, message lists as
    ``chat``), ``preference`` (TRL's ``prompt``/``chosen``/``rejected``: three strings, or three message lists; one
    staged row per record, no packing; trained by DPO, ``train.engine: hf``), ``unpaired_preference`` (TRL's
    ``prompt``/``completion`` and a boolean ``label``, true for a desirable completion, KTO's; one row per record).
    ``auto``: the shape is detected from the first records of ``train`` (logged, and part of the dataset
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
    packing: bool = True
    """Pack several records into each ``seq_len`` row (each still sees only itself); false: one record a row,
    padded. ``train.method: grpo`` stages one prompt a row whatever this says (it samples completions per prompt);
    preference formats are always one record a row."""
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
    event says, so this is its allow-list); empty = the folder holding ``data.train`` (each ``path`` of a mixture's;
    a hub dataset names none). Anything else is refused."""

    @field_validator("train", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        """A plain string as it is; one mapping, or a list of mappings and strings, as a list of TrainSource, every
        problem named by its entry (``data.train[1].weight``)."""
        if isinstance(value, str):
            return value
        if isinstance(value, dict | TrainSource):
            named = [("data.train", value)]
        elif isinstance(value, list):
            named = [(f"data.train[{i}]", item) for i, item in enumerate(value)]
        else:
            raise ValueError(f"expected a path, a mapping with path or hub, or a list of them; got {value!r}")
        if not named:
            raise ValueError("an empty list names no source; give at least one (a path, or a mapping with path or hub)")
        entries, problems = [], []
        for name, item in named:
            try:
                entries.append(_entry(item, name))
            except _EntryProblems as e:
                problems += e.problems
        if problems:
            raise ValidationError.from_exception_data("data.train", problems)
        return entries

    def resolve_paths(self, absolute: Callable[[str], str]) -> None:
        """Relative paths made absolute by ``absolute`` (the job runs elsewhere): ``train`` (each ``path`` of a list;
        a hub id is no path) and ``eval``."""
        if isinstance(self.train, str):
            self.train = absolute(self.train)
        else:
            self.train = [e if e.path is None else e.model_copy(update={"path": absolute(e.path)}) for e in self.train]
        self.eval = absolute(self.eval) if self.eval else self.eval

    @model_validator(mode="after")
    def _overlap_fits(self) -> DataConfig:
        if self.text_overlap_tokens > self.seq_len // 2:
            raise ValueError(
                f"data.text_overlap_tokens ({self.text_overlap_tokens}) must be at most half of data.seq_len "
                f"({self.seq_len}): a piece of a long document repeats that much and learns the rest"
            )
        return self


class _EntryProblems(Exception):
    def __init__(self, problems: list[InitErrorDetails]) -> None:
        self.problems = problems


def _entry(item: object, name: str) -> TrainSource:
    """One entry of ``data.train`` as a TrainSource; its problems each named ``<name>.<field>`` in the message (the
    loader prefixes a problem with the field it validated, ``data.train``, and no more)."""
    if isinstance(item, TrainSource):
        return item
    if isinstance(item, str):
        item = {"path": item}
    if not isinstance(item, dict):
        raise _EntryProblems([_problem(f"{name}: expected a path or a mapping with path or hub, got {item!r}", item)])
    try:
        return TrainSource.model_validate(item)
    except ValidationError as e:
        raise _EntryProblems([_problem(_said(name, err), item) for err in e.errors()]) from None


def _said(name: str, err: Any) -> str:
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    field, sep, rest = msg.partition(": ")
    if not where and sep and field in TrainSource.model_fields:  # a check of the whole entry that names its field
        where, msg = field, rest
    if err["type"] == "extra_forbidden":
        msg = f"unknown key (a source has {', '.join(TrainSource.model_fields)})"
    if name == "data.train":  # the one mapping: the loader's prefix names it already
        return f"{where}: {msg}" if where else msg
    return f"{name}.{where}: {msg}" if where else f"{name}: {msg}"


def _problem(message: str, value: object) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("data_train", "{message}", {"message": message}), loc=(), input=value
    )
