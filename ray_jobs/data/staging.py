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
from typing import Any, NamedTuple

from pydantic import JsonValue

from ray_jobs.config import DataConfig
from ray_jobs.config.record_formats import record_format
from ray_jobs.contracts.dataset import Counts, DatasetManifest, Shard, StagedSource, TokenizerInfo, read_manifest
from ray_jobs.data.fingerprint import Source, describe, hash_file, known_hashes, resolve_hashes
from ray_jobs.data.mixture import Mixture, empty_sources, mixture_shards, one_source_a_file, prepare
from ray_jobs.data.pack import ShardPart, contiguous_layout, pack, shard_count
from ray_jobs.data.read_progress import ProgressFn, ReadProgress
from ray_jobs.data.records import Record, Reject, parse_records, record_in_eval
from ray_jobs.data.refusal import empty_input, empty_split, too_many_rejects
from ray_jobs.data.report import counts_of, mixed_sources, summary
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
    actors across the nodes (the same shards, manifest and dataset id as ``local``). ``data.train`` is expanded
    first (a hub dataset loaded, a mixture's sources: ``ray_jobs/data/mixture.py``) and ``data.format: auto``
    resolved from the first records of each train source: the dataset id and manifest hold the detected shapes.
    ``progress(done, total, records=, tokens=)``: called as source bytes are read (ray_jobs.progress.Reporter.update);
    ``writing(done, total)``: as rows are written as shards, once every source was read."""
    data, mix = prepare(data)
    sources = describe_sources(data, mix)
    read = resolve_hashes(sources, storage, data.verify_sources, _hash_on_cluster if on == "cluster" else None)
    tok_fp = tokenizer_fingerprint(tokenizer)
    ds_id = dataset_id(sources, tok_fp, data, mix)
    layout = Layout(storage)
    manifest_url = layout.dataset_manifest(ds_id)
    if exists(manifest_url):
        return StageResult(ds_id, manifest_url, True, read_manifest(manifest_url), read)
    # two stagings of one dataset on this machine must never share a spill: the second waits, then finds it staged
    with exclusive_lock(Path(data.work_dir) / f"{ds_id}.lock", timeout_s=STAGING_LOCK_TIMEOUT_S):
        if exists(manifest_url):
            return StageResult(ds_id, manifest_url, True, read_manifest(manifest_url), read)
        target = _Target(ds_id, layout.dataset_dir(ds_id), on, mix)
        manifest = _stage_fresh(data, tokenizer, tokenizer_name, tok_fp, sources, target, progress, writing)
        write_json_atomic(manifest_url, manifest.dump())
    return StageResult(ds_id, manifest_url, False, manifest, read)


def cached(data: DataConfig, tokenizer, storage: str) -> StageResult | None:
    """The staged dataset when every source's fingerprint was hashed before and that dataset is on storage; None
    when finding out would take hashing sources (or staging). One metadata call per file, and no source bytes read
    but for ``data.format: auto``, whose shape (part of the dataset id) comes from the first records of each train
    source: up to 1 MB of its first file, or a Parquet file's schema (and a hub dataset, loaded from its cache)."""
    if data.verify_sources:
        return None
    data, mix = prepare(data)
    sources = describe_sources(data, mix)
    if not known_hashes(sources, storage):
        return None
    ds_id = dataset_id(sources, tokenizer_fingerprint(tokenizer), data, mix)
    url = Layout(storage).dataset_manifest(ds_id)
    return StageResult(ds_id, url, True, read_manifest(url)) if exists(url) else None


def describe_sources(data: DataConfig, mix: Mixture | None = None) -> dict[str, list[Source]]:
    """The files of every source by split (``data`` as :func:`prepare` made it: one train source is its URL)."""
    if mix is None:
        assert isinstance(data.train, str), "prepare() names one train source by its URL"
        sources = {"train": describe(data.train, "data.train")}
    else:
        sources = {"train": [f for i, s in enumerate(mix.sources) for f in describe(s.url, s.field, i)]}
        one_source_a_file(sources["train"], mix)
    if data.eval:
        sources["eval"] = describe(data.eval, "data.eval")
    return sources


def _hash_on_cluster(urls: list[str]) -> list[str]:
    """sha256 of each file, one Ray task per file spread over the cluster's nodes."""
    import ray

    task = ray.remote(hash_file).options(num_cpus=1, scheduling_strategy="SPREAD", max_retries=3)
    return ray_get([task.remote(u) for u in urls])


def dataset_id(sources: dict[str, list[Source]], tok_fp: str, data: DataConfig, mix: Mixture | None = None) -> str:
    hashes: dict[str, JsonValue] = {k: [f.sha256 for f in v] for k, v in sources.items()}
    if mix is not None:  # which files are whose
        hashes["train"] = [[f.sha256 for f in sources["train"] if f.source == i] for i in range(len(mix.sources))]
    spec = {"version": STAGING_VERSION, "sources": hashes, "tokenizer": tok_fp, "staging": staging_config(data, mix)}
    return "ds-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def staging_config(data: DataConfig, mix: Mixture | None = None) -> dict[str, JsonValue]:
    """The config fields that change what staging writes (and so the dataset id); a mixture's sources' weights and
    formats too."""
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
    names = {data.format} if mix is None else {s.format for s in mix.sources} | ({data.format} if data.eval else set())
    formats = [record_format(name) for name in names]
    if any(f.documents for f in formats):  # fields only some formats read: the others keep their id when these change
        out["text_overlap_tokens"] = data.text_overlap_tokens
    if not all(f.documents for f in formats):
        out["too_long"] = data.too_long
    if any(f.chat != "never" for f in formats):
        out["train_on"] = data.train_on
    if not data.packing:  # (only then: the ids of datasets staged before the option are kept)
        out["packing"] = False
    if mix is not None:
        out["format"] = mix.format
        out["mixture"] = mix.config()
    return out


class _Target(NamedTuple):
    """What a fresh staging makes, where, and how."""

    dataset_id: str
    out_dir: str
    on: str  # "local" or "cluster"
    mix: Mixture | None


def _stage_fresh(
    data, tokenizer, tokenizer_name, tok_fp, sources, target: _Target, progress=None, writing=None
) -> DatasetManifest:
    ds_id, out_dir, on, mix = target
    if tokenizer.eos_token_id is None:
        raise StagingError("the tokenizer has no EOS token; unbroken needs one to end each example")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # the spill names source files (rejects do): the same bytes under other names are another staging
    where = hashlib.sha256(json.dumps({k: [f.url for f in v] for k, v in sources.items()}).encode()).hexdigest()[:8]
    spill = Spill(Path(data.work_dir) / f"{ds_id}-{where}", ds_id, data.seq_len, pad, packer_for(data))
    # long documents' pieces: beside the spill when workers run here; through Ray's object store on a cluster
    formats = {f.url: mix.sources[f.source].format for f in sources["train"]} if mix else None
    work = BatchWork(tokenizer, tokenizer_name, data, None if on == "cluster" else str(spill.doc_dir), formats)
    for url in {f.url for files in sources.values() for f in files}:
        work.render(work.data_for(url))  # a chat format with no chat template fails here, before any source is read
    try:
        if spill.reading:
            _read_all(spill, work, sources, data, on, progress, mix is not None)
        _check_counts(spill, data, out_dir, sources, mix)
    except SourceUnreadable:
        raise  # a store that failed to answer: the spill stays, the next staging goes on from it
    except StagingError:
        spill.remove()  # bad data: the next staging is of fixed data, or under another policy; either reads afresh
        raise
    _remove_unfinished(out_dir)
    shards = _write_shards(spill, _layouts(spill, data, mix), out_dir, writing)
    upload_file(spill.rejects_file(), join(out_dir, "rejects.jsonl"))
    tok = TokenizerInfo(
        name_or_path=tokenizer_name,
        fingerprint=tok_fp,
        vocab_size=len(tokenizer),
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    manifest = _manifest(ds_id, data, sources, tok, counts_of(spill, shards), shards, mix)
    if mix is not None:
        manifest.mixture = mixed_sources(mix, spill, sources["train"])
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
    mix: Mixture | None = None,
) -> DatasetManifest:
    return DatasetManifest(
        dataset_id=ds_id,
        staging_version=STAGING_VERSION,
        seq_len=data.seq_len,
        sources={k: [StagedSource(url=f.url, bytes=f.size, sha256=f.sha256) for f in v] for k, v in sources.items()},
        tokenizer=tok,
        staging_config=staging_config(data, mix),
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
    mixed: bool = False,
) -> None:
    """Every source piece through the workers into the spill, recording progress as it goes (and telling
    ``progress`` the source bytes read, from where a resumed staging starts). ``mixed``: a mixture's sources each
    end their train rows (a row never holds two sources)."""
    files = [(split, f) for split, fs in sources.items() for f in fs]
    ends = (
        {i for i, (split, f) in enumerate(files) if split == "train" and _last_of_source(files, i)} if mixed else set()
    )
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
            if i in ends:
                spill.end_source()
            spill.commit(i + 1, Position())
        elif n % COMMIT_BATCHES == 0:
            spill.commit(i, at)
    spill.end_reading()


def _last_of_source(files: list[tuple[str, Source]], i: int) -> bool:
    return i + 1 == len(files) or files[i + 1][0] != "train" or files[i + 1][1].source != files[i][1].source


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


def _layouts(spill: Spill, data: DataConfig, mix: Mixture | None) -> dict[str, list[list[ShardPart]]]:
    """Which spill rows each shard of each split holds: consecutive rows, or a mixture's weighted train rows."""
    out = {
        split: contiguous_layout(spill.rows(split), split_shards(spill.rows(split), split, data)) for split in SPLITS
    }
    if mix is not None:
        out["train"] = mixture_shards(mix, spill.marks, lambda n: split_shards(n, "train", data))
    return out


def _write_shards(
    spill: Spill, layouts: dict[str, list[list[ShardPart]]], out_dir: str, writing: ProgressFn | None
) -> dict[str, list[Shard]]:
    """Every split's rows as Parquet shards, telling ``writing`` the rows written of all splits' rows."""
    sizes = {split: sum(p.rows for shard in layouts[split] for p in shard) for split in SPLITS}
    total, before, out = sum(sizes.values()), 0, {}
    for split in SPLITS:
        told = (lambda n, b=before: writing(b + n, total)) if writing else None
        out[split] = [Shard.model_validate(e) for e in spill.write_split(split, layouts[split], out_dir, told)]
        before += sizes[split]
    return out


def packer_for(data: DataConfig) -> type:
    """How examples become rows: packed several to a row, one record per row (``data.packing: false``), or one
    preference record (a pair, or an unpaired labelled completion) per row."""
    from ray_jobs.data import preference, unpaired
    from ray_jobs.data.pack import Packer, RowPerExample

    if (fmt := record_format(data.format)).pairs or fmt.labelled:
        return preference.PairPacker if fmt.pairs else unpaired.UnpairedPacker
    return Packer if data.packing else RowPerExample


def split_shards(rows: int, split: str, data: DataConfig) -> int:
    """The shards a split of ``rows`` rows is written as (``data.min_shards`` at least for train)."""
    return shard_count(rows, data.seq_len, data.shard_mb, data.min_shards if split == "train" else 1)


def _check_counts(
    spill: Spill, data: DataConfig, out_dir: str, sources: dict[str, list[Source]], mix: Mixture | None = None
) -> None:
    """The reject policy, then a train and an eval split that are not empty (each rule: ray_jobs/data/refusal.py)."""
    c = spill.counts
    if why := empty_input(c, [f for v in sources.values() for f in v]):
        raise StagingError(why)
    if why := too_many_rejects(c, data):
        url = join(out_dir, "rejects.jsonl")
        upload_file(spill.rejects_file(), url)
        first = "\n".join(f"  {r.where}: {r.reason}" for r in spill.first_rejects(5))
        more = f"\n  ... and {c['rejects'] - 5} more" if c["rejects"] > 5 else ""
        raise StagingError(f"{why}:\n{first}{more}\nall rejects: {url}")
    if why := empty_split(c, "train", sources["train"]):
        raise StagingError(why)
    if mix is not None and (empty := empty_sources(mix, spill.marks)):
        raise StagingError(f"{', '.join(empty)}: no usable train records (a mixture's source must give some)")
    if why := empty_split(c, "eval", sources["train"]):
        raise StagingError(why)
