"""Stage a dataset: read source records, validate each one, tokenize, pack, write Parquet shards + manifest.

The stages live in their own modules (sources, records, tokenize, pack); this one runs them in order and owns
what spans them: the dataset id, the train/eval split, the reject policy and the manifest.

The dataset id is a content hash of (source fingerprint, tokenizer fingerprint, staging config), so staging the
same thing again is a cache hit that writes nothing. Shards are written first and ``manifest.json`` last: a
crash mid-staging leaves no manifest, never a manifest pointing at missing shards.

A bad record is never dropped silently: it is written to ``rejects.jsonl`` with file, line and reason, and unless
``data.max_reject_fraction`` allows it, staging fails naming the first few ``file:line: reason``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ray_jobs.config import DataConfig
from ray_jobs.data.pack import Rows, pack, shard_count, write_shards
from ray_jobs.data.records import Record, Reject, parse_records, record_in_eval
from ray_jobs.data.sources import SourceFile, StagingError, list_sources, position_unit, read_sources
from ray_jobs.data.tokenize import IGNORE_INDEX, Tokenized, chat_renderer, tokenizer_fingerprint
from ray_jobs.storage import Layout, exists, join, read_json, write_bytes_atomic, write_json_atomic

# What other modules import from here (the stages' own modules are the homes).
__all__ = [
    "IGNORE_INDEX", "STAGING_VERSION", "Record", "Reject", "SourceFile", "StageResult", "StagingError", "chat_renderer",
    "dataset_id", "list_sources", "pack", "parse_records", "position_unit", "read_sources", "record_in_eval", "stage",
]  # fmt: skip

# 2: pairs tokenized as one text, chat learns assistant turns by offsets, shards carry position_ids.
STAGING_VERSION = 2


@dataclass
class StageResult:
    dataset_id: str
    manifest_url: str
    cache_hit: bool
    manifest: dict[str, Any]


def stage(data: DataConfig, tokenizer, tokenizer_name: str, storage: str) -> StageResult:
    """Stage ``data`` onto ``storage`` with ``tokenizer``; a cache hit when the same inputs were staged before."""
    sources = {"train": read_sources(data.train, "data.train")}
    if data.eval:
        sources["eval"] = read_sources(data.eval, "data.eval")
    tok_fp = tokenizer_fingerprint(tokenizer)
    ds_id = dataset_id(sources, tok_fp, data)
    layout = Layout(storage)
    manifest_url = layout.dataset_manifest(ds_id)
    if exists(manifest_url):
        return StageResult(ds_id, manifest_url, True, read_json(manifest_url))
    manifest = _stage_fresh(data, tokenizer, tokenizer_name, tok_fp, sources, ds_id, layout.dataset_dir(ds_id))
    write_json_atomic(manifest_url, manifest)
    return StageResult(ds_id, manifest_url, False, manifest)


def dataset_id(sources: dict[str, list[SourceFile]], tok_fp: str, data: DataConfig) -> str:
    spec = {
        "version": STAGING_VERSION,
        "sources": {k: [f.sha256 for f in v] for k, v in sources.items()},
        "tokenizer": tok_fp,
        "staging": staging_config(data),
    }
    return "ds-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def staging_config(data: DataConfig) -> dict[str, Any]:
    """The config fields that change what staging writes (and so the dataset id)."""
    keys = (
        "format", "input_field", "target_field", "text_field", "messages_field", "eval_fraction", "seq_len",
        "max_record_chars", "shard_mb", "min_shards",
    )  # fmt: skip
    out = {k: getattr(data, k) for k in keys}
    out["separate_eval"] = data.eval is not None
    if data.format == "chat":  # only chat reads it: other formats keep their id when it changes
        out["train_on"] = data.train_on
    return out


def _stage_fresh(data, tokenizer, tokenizer_name, tok_fp, sources, ds_id, out_dir) -> dict[str, Any]:
    render = chat_renderer(tokenizer, tokenizer_name, data.train_on) if data.format == "chat" else None
    records, rejects = _validate_all(sources, data, render)
    total = len(records) + len(rejects)
    tokenized = _tokenize(tokenizer, _split(records, data, sources), data)
    rejects += tokenized["train"].rejects + tokenized["eval"].rejects
    _enforce_reject_policy(rejects, total, data, out_dir, sources)
    if not tokenized["train"].examples:
        raise StagingError(f"data.train: no usable records in {_names(sources['train'])}")
    if not tokenized["eval"].examples:
        raise StagingError("the eval split is empty: raise data.eval_fraction or set data.eval")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = {split: pack(t.examples, data.seq_len, pad) for split, t in tokenized.items()}
    shards = {split: _write_split(split, r, data, out_dir) for split, r in rows.items()}
    _write_rejects(rejects, out_dir)
    tok_info = {"name_or_path": tokenizer_name, "fingerprint": tok_fp, "vocab_size": len(tokenizer),
                "pad_token_id": pad, "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    return {
        "dataset_id": ds_id,
        "staging_version": STAGING_VERSION,
        "seq_len": data.seq_len,
        "sources": {
            k: [{"url": f.url, "bytes": len(f.data), "sha256": f.sha256} for f in v] for k, v in sources.items()
        },
        "tokenizer": tok_info,
        "staging_config": staging_config(data),
        "counts": _counts(total, rejects, tokenized, rows),
        "shards": shards,
    }


def _tokenize(tokenizer, splits: tuple[list[Record], list[Record]], data: DataConfig) -> dict[str, Tokenized]:
    # a chat rendering already holds the template's special tokens; adding the tokenizer's would double BOS
    specials = data.format != "chat"
    return {
        name: Tokenized(tokenizer, recs, data.seq_len, add_special_tokens=specials)
        for name, recs in zip(("train", "eval"), splits, strict=True)
    }


def _write_split(split: str, rows: Rows, data: DataConfig, out_dir: str) -> list[dict[str, Any]]:
    min_shards = data.min_shards if split == "train" else 1
    return write_shards(split, rows, shard_count(len(rows.ids), data.seq_len, data.shard_mb, min_shards), out_dir)


def _counts(total: int, rejects: list[Reject], tokenized: dict[str, Tokenized], rows: dict[str, Rows]) -> dict:
    return {
        "records": total,
        "rejects": len(rejects),
        "train_examples": len(tokenized["train"].examples),
        "eval_examples": len(tokenized["eval"].examples),
        "train_rows": len(rows["train"].ids),
        "eval_rows": len(rows["eval"].ids),
        "train_tokens": sum(len(ids) for ids, _ in tokenized["train"].examples),
        "train_target_tokens": sum(sum(1 for x in lab if x != IGNORE_INDEX) for lab in rows["train"].labels),
    }


def _validate_all(sources, data, render) -> tuple[list[Record], list[Reject]]:
    records: list[Record] = []
    rejects: list[Reject] = []
    for split, files in sources.items():
        for f in files:
            recs, rejs = parse_records(f, data, split, render)
            records += recs
            rejects += rejs
    return records, rejects


def _split(records: list[Record], data: DataConfig, sources) -> tuple[list[Record], list[Record]]:
    if "eval" in sources:
        return [r for r in records if r.split == "train"], [r for r in records if r.split == "eval"]
    ev = [record_in_eval(r, data.eval_fraction) for r in records]
    return [r for r, e in zip(records, ev, strict=True) if not e], [r for r, e in zip(records, ev, strict=True) if e]


def _enforce_reject_policy(rejects, total, data, out_dir, sources) -> None:
    if total == 0:
        raise StagingError(f"no records found in {_names([f for v in sources.values() for f in v])} (empty input)")
    if not rejects or len(rejects) / total <= data.max_reject_fraction:
        return
    url = _write_rejects(rejects, out_dir)
    first = "\n".join(f"  {r.where}: {r.reason}" for r in rejects[:5])
    more = f"\n  ... and {len(rejects) - 5} more" if len(rejects) > 5 else ""
    raise StagingError(
        f"{len(rejects)} of {total} records rejected ({len(rejects) / total:.1%}), over "
        f"data.max_reject_fraction={data.max_reject_fraction}:\n{first}{more}\nall rejects: {url}"
    )


def _write_rejects(rejects: list[Reject], out_dir: str) -> str:
    url = join(out_dir, "rejects.jsonl")
    body = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rejects)
    write_bytes_atomic(url, body.encode())
    return url


def _names(files: list[SourceFile]) -> str:
    return ", ".join(f.url for f in files)
