"""Stage a dataset: read source records, validate each one, tokenize, pack, write Parquet shards + manifest.

The stages live in their own modules (sources, records, tokenize, pack, workers, spill); this one runs them in order
and owns what spans them: the dataset id, the reject policy and the manifest.

Staging streams: sources are cut into pieces that workers read, validate and tokenize (a pool of processes here, or
Ray actors across the cluster's nodes when ``on="cluster"``; results taken in source order), packed, and spilled to
local disk as int32 rows; once every source was read the rows are cut into shards. Memory is a few pieces plus one
shard, whatever the dataset's size, and the output is byte-identical to what reading everything into memory wrote (the shard boundaries need the total row count, hence the spill).

The dataset id is a content hash of (source sha256s, tokenizer fingerprint, staging config), so staging the same
thing again is a cache hit that writes nothing; a source's sha256 comes from its size and version marker when an
earlier staging hashed that version (``fingerprint``), so a cache hit reads no source bytes. Shards are written
first and ``manifest.json`` last: a crash mid-staging leaves no manifest, never a manifest pointing at missing
shards, and the next staging resumes from the spill's progress.

A bad record is never dropped silently: it is written to ``rejects.jsonl`` with file, line and reason, and unless
``data.max_reject_fraction`` allows it, staging fails naming the first few ``file:line: reason``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import JsonValue

from ray_jobs.config import DataConfig
from ray_jobs.contracts.dataset import Counts, DatasetManifest, Shard, StagedSource, TokenizerInfo, read_manifest
from ray_jobs.data.fingerprint import Source, describe, hash_file, known_hashes, resolve_hashes
from ray_jobs.data.pack import pack, shard_count
from ray_jobs.data.read_progress import ProgressFn, ReadProgress
from ray_jobs.data.records import Record, Reject, parse_records, record_in_eval
from ray_jobs.data.sources import (
    Position,
    SourceFile,
    SourceUnreadable,
    StagingError,
    list_sources,
    pieces,
    position_unit,
    read_sources,
)
from ray_jobs.data.spill import SPLITS, Spill
from ray_jobs.data.tokenize import IGNORE_INDEX, chat_renderer, tokenizer_fingerprint
from ray_jobs.data.workers import BatchWork, cluster_size, pool_size, ray_get, ray_results, results
from ray_jobs.storage import Layout, exclusive_lock, exists, join, remove_temporaries, upload_file, write_json_atomic

# What other modules import from here (the stages' own modules are the homes).
__all__ = [
    "IGNORE_INDEX", "STAGING_VERSION", "Record", "Reject", "SourceFile", "StageResult", "StagingError", "cached",
    "chat_renderer", "dataset_id", "list_sources", "pack", "parse_records", "position_unit", "read_sources",
    "record_in_eval", "stage",
]  # fmt: skip

# 2: pairs tokenized as one text, chat learns assistant turns by offsets, shards carry position_ids.
# 3: text documents longer than seq_len cut into pieces; data.too_long; the shapes of other tools.
STAGING_VERSION = 3
BATCH_BYTES = 4 << 20  # of source per piece a worker reads
COMMIT_BATCHES = 8  # progress is recorded every this many pieces (and at the end of every source file)

# The other staging of this dataset may run for hours on a big source; one holding it for a day is hung.
STAGING_LOCK_TIMEOUT_S = 24 * 3600.0


@dataclass
class StageResult:
    dataset_id: str
    manifest_url: str
    cache_hit: bool
    manifest: DatasetManifest
    sources_read: int = 0  # source files whose bytes were read to learn their sha256 (0: fingerprints sufficed)


def stage(
    data: DataConfig,
    tokenizer,
    tokenizer_name: str,
    storage: str,
    on: str = "local",
    progress: ProgressFn | None = None,
    writing: ProgressFn | None = None,
) -> StageResult:
    """Stage ``data`` onto ``storage`` with ``tokenizer``; a cache hit when the same inputs were staged before.
    ``on="cluster"``: from a driver on a Ray cluster, its sources hashed and its pieces tokenized by Ray tasks and
    actors across the nodes (the same shards, manifest and dataset id as ``local``). ``data.format: auto`` is
    resolved first, from the first records of ``data.train``: the dataset id and manifest hold the detected shape.
    ``progress(done, total, records=, tokens=)``: called as source bytes are read (ray_jobs.progress.Reporter.update);
    ``writing(done, total)``: as rows are written as shards, once every source was read."""
    from ray_jobs.data.shapes import resolve_format

    data = resolve_format(data)
    sources = describe_sources(data)
    read = resolve_hashes(sources, storage, data.verify_sources, _hash_on_cluster if on == "cluster" else None)
    tok_fp = tokenizer_fingerprint(tokenizer)
    ds_id = dataset_id(sources, tok_fp, data)
    layout = Layout(storage)
    manifest_url = layout.dataset_manifest(ds_id)
    if exists(manifest_url):
        return StageResult(ds_id, manifest_url, True, read_manifest(manifest_url), read)
    # two stagings of one dataset on this machine must never share a spill: the second waits, then finds it staged
    with exclusive_lock(Path(data.work_dir) / f"{ds_id}.lock", timeout_s=STAGING_LOCK_TIMEOUT_S):
        if exists(manifest_url):
            return StageResult(ds_id, manifest_url, True, read_manifest(manifest_url), read)
        out_dir = layout.dataset_dir(ds_id)
        manifest = _stage_fresh(data, tokenizer, tokenizer_name, tok_fp, sources, ds_id, out_dir, on, progress, writing)
        write_json_atomic(manifest_url, manifest.dump())
    return StageResult(ds_id, manifest_url, False, manifest, read)


def cached(data: DataConfig, tokenizer, storage: str) -> StageResult | None:
    """The staged dataset when every source's fingerprint was hashed before and that dataset is on storage; None
    when finding out would take hashing sources (or staging). One metadata call per file, and no source bytes read
    but for ``data.format: auto``, whose shape (part of the dataset id) comes from the first records of
    ``data.train``: up to 1 MB of its first file, or a Parquet file's schema."""
    from ray_jobs.data.shapes import resolve_format

    if data.verify_sources:
        return None
    sources = describe_sources(data)
    if not known_hashes(sources, storage):
        return None
    data = resolve_format(data)
    ds_id = dataset_id(sources, tokenizer_fingerprint(tokenizer), data)
    url = Layout(storage).dataset_manifest(ds_id)
    return StageResult(ds_id, url, True, read_manifest(url)) if exists(url) else None


def describe_sources(data: DataConfig) -> dict[str, list[Source]]:
    sources = {"train": describe(data.train, "data.train")}
    if data.eval:
        sources["eval"] = describe(data.eval, "data.eval")
    return sources


def _hash_on_cluster(urls: list[str]) -> list[str]:
    """sha256 of each file, one Ray task per file spread over the cluster's nodes."""
    import ray

    task = ray.remote(hash_file).options(num_cpus=1, scheduling_strategy="SPREAD", max_retries=3)
    return ray_get([task.remote(u) for u in urls])


def dataset_id(sources: dict[str, list[Source]], tok_fp: str, data: DataConfig) -> str:
    spec = {
        "version": STAGING_VERSION,
        "sources": {k: [f.sha256 for f in v] for k, v in sources.items()},
        "tokenizer": tok_fp,
        "staging": staging_config(data),
    }
    return "ds-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def staging_config(data: DataConfig) -> dict[str, JsonValue]:
    """The config fields that change what staging writes (and so the dataset id)."""
    keys = (
        "format",
        "input_field",
        "target_field",
        "text_field",
        "messages_field",
        "eval_fraction",
        "seq_len",
        "max_record_chars",
        "shard_mb",
        "min_shards",
    )
    out: dict[str, JsonValue] = {k: getattr(data, k) for k in keys}
    out["separate_eval"] = data.eval is not None
    if data.format == "text":  # fields only some formats read: the others keep their id when these change
        out["text_overlap_tokens"] = data.text_overlap_tokens
    else:
        out["too_long"] = data.too_long
    if data.format != "pairs" and data.format != "text":
        out["train_on"] = data.train_on
    return out


def _stage_fresh(
    data, tokenizer, tokenizer_name, tok_fp, sources, ds_id, out_dir, on, progress=None, writing=None
) -> DatasetManifest:
    if tokenizer.eos_token_id is None:
        raise StagingError("the tokenizer has no EOS token; unbroken needs one to end each example")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # the spill names source files (rejects do): the same bytes under other names are another staging
    where = hashlib.sha256(json.dumps({k: [f.url for f in v] for k, v in sources.items()}).encode()).hexdigest()[:8]
    spill = Spill(Path(data.work_dir) / f"{ds_id}-{where}", ds_id, data.seq_len, pad, packer_for(data))
    # long documents' pieces: beside the spill when workers run here; through Ray's object store on a cluster
    work = BatchWork(tokenizer, tokenizer_name, data, None if on == "cluster" else str(spill.doc_dir))
    work.render()  # a chat format with no chat template fails here, before any source is read
    try:
        if spill.reading:
            _read_all(spill, work, sources, data, on, progress)
        _check_counts(spill, data, out_dir, sources)
    except SourceUnreadable:
        raise  # a store that failed to answer: the spill stays, the next staging goes on from it
    except StagingError:
        spill.remove()  # bad data: the next staging is of fixed data, or under another policy; either reads afresh
        raise
    _remove_unfinished(out_dir)
    shards = _write_shards(spill, data, out_dir, writing)
    upload_file(spill.rejects_file(), join(out_dir, "rejects.jsonl"))
    tok = TokenizerInfo(
        name_or_path=tokenizer_name,
        fingerprint=tok_fp,
        vocab_size=len(tokenizer),
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    manifest = _manifest(ds_id, data, sources, tok, _counts(spill), shards)
    spill.remove()
    logging.getLogger("unbroken.staging").info("staged %s: %s", ds_id, summary(manifest))
    return manifest


def _remove_unfinished(out_dir: str) -> None:
    """A staging killed between creating a shard's temporary file and renaming it left that file in the dataset's
    folder; this staging, holding the dataset's lock, writes that shard again from its spill, so the file goes."""
    orphans = remove_temporaries(out_dir)
    if orphans:
        log = logging.getLogger("unbroken.staging")
        log.info("removed %d unfinished file(s) a killed staging left in %s: %s", len(orphans), out_dir, orphans)


def _manifest(
    ds_id: str,
    data: DataConfig,
    sources: dict[str, list[Source]],
    tok: TokenizerInfo,
    counts: Counts,
    shards: dict[str, list[Shard]],
) -> DatasetManifest:
    return DatasetManifest(
        dataset_id=ds_id,
        staging_version=STAGING_VERSION,
        seq_len=data.seq_len,
        sources={k: [StagedSource(url=f.url, bytes=f.size, sha256=f.sha256) for f in v] for k, v in sources.items()},
        tokenizer=tok,
        staging_config=staging_config(data),
        counts=counts,
        shards=shards,
    )


def _read_all(
    spill: Spill,
    work: BatchWork,
    sources: dict[str, list[Source]],
    data: DataConfig,
    on: str,
    progress: ProgressFn | None = None,
) -> None:
    """Every source piece through the workers into the spill, recording progress as it goes (and telling
    ``progress`` the source bytes read, from where a resumed staging starts)."""
    files = [(split, f) for split, fs in sources.items() for f in fs]
    if on == "cluster":
        run, workers = ray_results, cluster_size(data)
    else:
        run, workers = results, pool_size(data, sum(f.size for _, f in files))
    current, at = spill.start
    told = ReadProgress(files, progress)
    told(current, at, spill.counts)
    for n, ((i, last), result) in enumerate(run(work, _pieces(files, current, at), workers), start=1):
        if i != current:
            current, at = i, Position()
        at = result.placed(at)
        spill.add(result)
        told(i, at, spill.counts, file_done=last)
        if last:
            _unchanged(files[i][1])
            spill.commit(i + 1, Position())
        elif n % COMMIT_BATCHES == 0:
            spill.commit(i, at)
    spill.end_reading()


def _unchanged(src: Source) -> None:
    """The file read is the file the dataset id was computed from (a writer may have replaced it meanwhile)."""
    (now,) = describe(src.url, "data")
    if (now.size, now.version) != (src.size, src.version):
        raise StagingError(
            f"{src.url} changed while it was being staged (size/version {src.size}/{src.version} -> "
            f"{now.size}/{now.version}); stage again once it is complete"
        )


def _pieces(files: list[tuple[str, Source]], first: int, at: Position) -> Iterator[tuple[tuple, str, Any]]:
    """``((file index, last of its file), split, piece)`` from file ``first`` at ``at`` on."""
    for i in range(first, len(files)):
        split, src = files[i]
        todo = pieces(src.url, src.size, at if i == first else Position(), BATCH_BYTES)
        piece = next(todo)
        while piece is not None:
            following = next(todo, None)
            yield (i, following is None), split, piece
            piece = following


def _write_shards(spill: Spill, data: DataConfig, out_dir: str, writing: ProgressFn | None) -> dict[str, list[Shard]]:
    """Every split's rows as Parquet shards, telling ``writing`` the rows written of all splits' rows."""
    total, before, out = sum(spill.rows(s) for s in SPLITS), 0, {}
    for split in SPLITS:
        told = (lambda n, b=before: writing(b + n, total)) if writing else None
        out[split] = [
            Shard.model_validate(e) for e in spill.write_split(split, _shards(spill, split, data), out_dir, told)
        ]
        before += spill.rows(split)
    return out


def packer_for(data: DataConfig) -> type:
    """How examples become rows: packed several to a row, or one preference record per row."""
    from ray_jobs.data.pack import Packer
    from ray_jobs.data.preference import PairPacker

    return PairPacker if data.format == "preference" else Packer


def _shards(spill: Spill, split: str, data: DataConfig) -> int:
    return shard_count(spill.rows(split), data.seq_len, data.shard_mb, data.min_shards if split == "train" else 1)


def _counts(spill: Spill) -> Counts:
    c = spill.counts
    kept = {name: c[name] for name in Counts.model_fields if name in c}
    return Counts(**kept, train_rows=spill.rows("train"), eval_rows=spill.rows("eval"))


def summary(manifest: DatasetManifest) -> str:
    """What staging made of the records, in one line (the staging log's, and the flow's)."""
    counts, conf = manifest.counts, manifest.staging_config
    if manifest.format == "text":
        return (
            f"{counts.documents} documents -> {counts.pieces} pieces ({counts.cut_documents} cut into "
            f"pieces of at most {conf['seq_len']} tokens), {counts.train_tokens} train tokens"
        )
    out = f"{counts.records} records ({counts.rejects} rejected"
    if counts.dropped or counts.truncated:
        out += f", {counts.dropped} dropped and {counts.truncated} truncated by data.too_long={conf['too_long']}"
    return out + f"), {counts.train_tokens} train tokens"


def _check_counts(spill: Spill, data: DataConfig, out_dir: str, sources: dict[str, list[Source]]) -> None:
    """The reject policy, then a train and an eval split that are not empty."""
    total, rejected = spill.counts["records"], spill.counts["rejects"]
    if total == 0:
        raise StagingError(f"no records found in {_names([f for v in sources.values() for f in v])} (empty input)")
    if rejected and rejected / total > data.max_reject_fraction:
        url = join(out_dir, "rejects.jsonl")
        upload_file(spill.rejects_file(), url)
        first = "\n".join(f"  {r.where}: {r.reason}" for r in spill.first_rejects(5))
        more = f"\n  ... and {rejected - 5} more" if rejected > 5 else ""
        raise StagingError(
            f"{rejected} of {total} records rejected ({rejected / total:.1%}), over "
            f"data.max_reject_fraction={data.max_reject_fraction}:\n{first}{more}\nall rejects: {url}"
        )
    if not spill.counts["train_examples"]:
        raise StagingError(f"data.train: no usable records in {_names(sources['train'])}")
    if not spill.counts["eval_examples"]:
        raise StagingError("the eval split is empty: raise data.eval_fraction or set data.eval")


def _names(files: list[Source]) -> str:
    return ", ".join(f.url for f in files)
