"""Stage a dataset: read source records, validate each one, tokenize, pack, write Parquet shards + manifest.

The dataset id is a content hash of (source fingerprint, tokenizer fingerprint, staging config), so staging the
same thing again is a cache hit that writes nothing. Shards are written first and ``manifest.json`` last: a
crash mid-staging leaves no manifest, never a manifest pointing at missing shards.

A bad record is never dropped silently: it is written to ``rejects.jsonl`` with file, line and reason, and unless
``data.max_reject_fraction`` allows it, staging fails naming the first few ``file:line: reason``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ray_jobs.config import DataConfig
from ray_jobs.storage import Layout, as_url, exists, fs_and_path, join, read_json, write_bytes_atomic, write_json_atomic

STAGING_VERSION = 1
IGNORE_INDEX = -100
_SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")


class StagingError(ValueError):
    """Data that cannot be staged; the message names the file (and line) at fault."""


def position_unit(url: str) -> str:
    """How a record's position in a source file is counted: JSONL lines, or rows of a columnar file."""
    return "row" if url.endswith((".parquet", ".arrow")) else "line"


@dataclass
class Record:
    file: str
    line: int
    prompt: str
    target: str
    split: str = "train"


@dataclass
class Reject:
    file: str
    line: int  # 1-based line of a JSONL file, or row of a Parquet file (see ``unit``)
    reason: str
    text: str = ""
    unit: str = "line"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file}:row {self.line}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, self.unit: self.line, "reason": self.reason, "text": self.text}


@dataclass
class SourceFile:
    url: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def unit(self) -> str:
        return position_unit(self.url)


def list_sources(url: str, field_name: str = "data.train") -> list[str]:
    """The files of a source: the file itself, a ``datasets`` ``save_to_disk`` folder's Arrow files, or every
    JSONL/Parquet file under a folder, sorted."""
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)  # a bucket listing cached earlier in this process may predate new files
    if not fs.exists(path):
        raise StagingError(f"{field_name}: no such file or folder: {url}")
    if fs.isfile(path):
        return [url]
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    if "dataset_dict.json" in names:
        raise StagingError(f"{field_name}: {url} holds several splits (a DatasetDict); point at one, e.g. {url}/train")
    if "state.json" in names:  # a datasets.Dataset.save_to_disk folder: its Arrow files, in order
        with fs.open(f"{path.rstrip('/')}/state.json") as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
        return [f"{url.rstrip('/')}/{name}" for name in files]
    found = sorted(p for p in fs.find(path) if p.endswith(_SOURCE_SUFFIXES))
    if not found:
        raise StagingError(f"{field_name}: folder {url} has no {'/'.join(_SOURCE_SUFFIXES)} files")
    return [as_url(url, p) for p in found]


def read_sources(url: str, field_name: str) -> list[SourceFile]:
    out = []
    for u in list_sources(url, field_name):
        fs, path = fs_and_path(u)
        try:
            with fs.open(path, "rb") as f:
                out.append(SourceFile(u, f.read()))
        except OSError as e:
            raise StagingError(f"{u}: cannot read: {e}") from e
    return out


def parse_records(
    src: SourceFile, data: DataConfig, split: str = "train", render=None
) -> tuple[list[Record], list[Reject]]:
    """Check every record of one source file; each becomes a Record or a Reject, none is lost.

    ``render`` turns chat messages into (prompt, target) text (the tokenizer's chat template); only ``chat`` needs it.
    """
    records: list[Record] = []
    rejects: list[Reject] = []
    for pos, obj, problem, preview in _objects(src):
        if problem is None:
            problem, prompt, target = _check(obj, data, render)
        if problem:
            rejects.append(Reject(src.url, pos, problem, preview, src.unit))
        else:
            records.append(Record(src.url, pos, prompt, target, split=split))
    return records, rejects


def _objects(src: SourceFile):
    """(position, object, problem, preview) for each record: JSONL lines (blank ones are not records) or Parquet rows."""
    if src.unit == "row":
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrow = src.url.endswith(".arrow")
        try:
            table = (
                pa.ipc.open_stream(io.BytesIO(src.data)).read_all() if arrow else pq.read_table(io.BytesIO(src.data))
            )
            rows = table.to_pylist()
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise StagingError(f"{src.url}: not a readable {'Arrow' if arrow else 'Parquet'} file: {e}") from e
        for i, row in enumerate(rows, start=1):
            yield i, row, None, json.dumps(row, default=str)[:200]
        return
    for lineno, raw in enumerate(src.data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        preview = raw[:200].decode("utf-8", errors="replace")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield lineno, None, f"invalid UTF-8 at byte {e.start}", preview
            continue
        try:
            yield lineno, json.loads(text), None, preview
        except json.JSONDecodeError as e:
            yield lineno, None, f"invalid JSON: {e.msg} (column {e.colno})", preview


def _check(obj: Any, data: DataConfig, render) -> tuple[str | None, str, str]:
    """(problem, prompt, target) of one decoded record under ``data.format``."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}", "", ""
    if data.format == "chat":
        problem, prompt, target = _check_chat(obj, data.messages_field, render)
    else:
        fields = (data.input_field, data.target_field) if data.format == "pairs" else (data.text_field,)
        problem = next(filter(None, (_string_problem(obj, f) for f in fields)), None)
        if problem:
            return problem, "", ""
        prompt, target = (obj[fields[0]], obj[fields[1]]) if data.format == "pairs" else ("", obj[fields[0]])
    if problem:
        return problem, "", ""
    if len(prompt) + len(target) > data.max_record_chars:
        n = len(prompt) + len(target)
        return f"record is {n} characters, over data.max_record_chars ({data.max_record_chars})", "", ""
    return None, prompt, target


def _string_problem(obj: dict, key: str) -> str | None:
    if key not in obj:
        return f"missing field {key!r}"
    if not isinstance(obj[key], str):
        return f"field {key!r} must be a string, got {type(obj[key]).__name__}"
    if not obj[key].strip():
        return f"field {key!r} is empty"
    return None


def _check_chat(obj: dict, key: str, render) -> tuple[str | None, str, str]:
    msgs = obj.get(key)
    if key not in obj:
        return f"missing field {key!r}", "", ""
    if not isinstance(msgs, list) or not msgs:
        return f"field {key!r} must be a non-empty list of messages", "", ""
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"{key}[{i}] must be an object with string 'role' and 'content'", "", ""
        if not m["content"].strip():
            return f"{key}[{i}] has empty content", "", ""
    if msgs[-1]["role"] != "assistant":
        return f"the last message must be the assistant's (got {msgs[-1]['role']!r})", "", ""
    try:
        prompt, target = render(msgs)
    except Exception as e:  # a template error names the record, not the whole run
        return f"chat template failed: {e}", "", ""
    return None, prompt, target


def chat_renderer(tokenizer, name: str):
    """(prompt, target) text of a conversation: everything before the final assistant reply, and the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise StagingError(
            f"data.format=chat needs a tokenizer with a chat template; the tokenizer of {name} has none "
            "(use data.format=pairs, or a model whose tokenizer_config.json has a chat_template)"
        )

    def render(msgs: list[dict]) -> tuple[str, str]:
        prompt = tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("the rendered conversation does not start with its rendered prompt")
        return prompt, full[len(prompt) :]

    return render


def record_in_eval(rec: Record, eval_fraction: float) -> bool:
    """Hash split: a record's side depends only on its content, so adding records never reshuffles."""
    h = hashlib.sha256(f"{rec.prompt}\0{rec.target}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < eval_fraction


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True)
    return hashlib.sha256((body + specials).encode()).hexdigest()


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
    return out


class Tokenized:
    """Token ids and loss labels of records; prompt tokens (and BOS) are masked from the loss."""

    def __init__(self, tokenizer, records: list[Record], seq_len: int):
        if tokenizer.eos_token_id is None:
            raise StagingError("the tokenizer has no EOS token; unbroken needs one to end each example")
        bos_id, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.unk = tokenizer.unk_token_id
        prompts = _encode(tokenizer, [r.prompt for r in records])
        targets = _encode(tokenizer, [r.target for r in records])
        self.examples: list[tuple[list[int], list[int]]] = []
        self.rejects: list[Reject] = []
        for rec, p, t in zip(records, prompts, targets, strict=True):
            bos = [bos_id] if bos_id is not None and p[:1] != [bos_id] else []
            eos = [self.eos] if t[-1:] != [self.eos] else []
            ids = bos + p + t + eos
            problem = self._problem(ids, seq_len)
            if problem:
                preview = (rec.prompt + rec.target)[:200]
                self.rejects.append(Reject(rec.file, rec.line, problem, preview, position_unit(rec.file)))
                continue
            labels = [IGNORE_INDEX] * (len(bos) + len(p)) + t + eos
            self.examples.append((ids, labels))

    def _problem(self, ids: list[int], seq_len: int) -> str | None:
        if self.unk is not None and self.unk in ids:
            return "contains characters the tokenizer cannot represent (would become <unk>)"
        if len(ids) > seq_len:
            return f"record is {len(ids)} tokens, longer than data.seq_len ({seq_len})"
        return None


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Batched encode; a fast tokenizer's Rust backend is called directly (it parallelises across cores, and
    skips transformers' per-record conversion into dicts of masks staging never uses). Same ids either way."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[list, list]:
    """Greedy in-order packing into fixed-length rows; an example never straddles two rows."""
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    for ids, labels in examples:
        if len(cur_ids) + len(ids) > seq_len:
            _close_row(rows_ids, rows_labels, cur_ids, cur_labels, seq_len, pad_id)
            cur_ids, cur_labels = [], []
        cur_ids += ids
        cur_labels += labels
    if cur_ids:
        _close_row(rows_ids, rows_labels, cur_ids, cur_labels, seq_len, pad_id)
    return rows_ids, rows_labels


def _close_row(rows_ids, rows_labels, ids, labels, seq_len, pad_id) -> None:
    pad = seq_len - len(ids)
    rows_ids.append(ids + [pad_id] * pad)
    rows_labels.append(labels + [IGNORE_INDEX] * pad)


def shard_count(n_rows: int, seq_len: int, shard_mb: float, min_shards: int) -> int:
    bytes_per_row = seq_len * 4 * 2  # int32 input_ids + int32 labels
    by_size = math.ceil(n_rows * bytes_per_row / (shard_mb * 1e6))
    return max(1, min(n_rows, max(by_size, min_shards)))


def write_shards(split: str, rows: tuple[list, list], n_shards: int, out_dir: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids, labels = rows
    bounds = [round(i * len(ids) / n_shards) for i in range(n_shards + 1)]
    entries = []
    for i in range(n_shards):
        lo, hi = bounds[i], bounds[i + 1]
        table = pa.table(
            {
                "input_ids": pa.array(ids[lo:hi], type=pa.list_(pa.int32())),
                "labels": pa.array(labels[lo:hi], type=pa.list_(pa.int32())),
            }
        )
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        name = f"{split}-{i:05d}.parquet"
        write_bytes_atomic(join(out_dir, name), data)
        entries.append({"file": name, "rows": hi - lo, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return entries


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


def _stage_fresh(data, tokenizer, tokenizer_name, tok_fp, sources, ds_id, out_dir) -> dict[str, Any]:
    render = chat_renderer(tokenizer, tokenizer_name) if data.format == "chat" else None
    records, rejects = _validate_all(sources, data, render)
    total = len(records) + len(rejects)
    train, evals = _split(records, data, sources)
    tokenized = {"train": Tokenized(tokenizer, train, data.seq_len), "eval": Tokenized(tokenizer, evals, data.seq_len)}
    rejects += tokenized["train"].rejects + tokenized["eval"].rejects
    _enforce_reject_policy(rejects, total, data, out_dir, sources)
    if not tokenized["train"].examples:
        raise StagingError(f"data.train: no usable records in {_names(sources['train'])}")
    if not tokenized["eval"].examples:
        raise StagingError("the eval split is empty: raise data.eval_fraction or set data.eval")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = {split: pack(t.examples, data.seq_len, pad) for split, t in tokenized.items()}
    min_shards = {"train": data.min_shards, "eval": 1}
    shards = {
        split: write_shards(split, r, shard_count(len(r[0]), data.seq_len, data.shard_mb, min_shards[split]), out_dir)
        for split, r in rows.items()
    }
    _write_rejects(rejects, out_dir)
    counts = _counts(total, rejects, tokenized, rows)
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
        "counts": counts,
        "shards": shards,
    }


def _counts(total: int, rejects: list[Reject], tokenized: dict[str, Tokenized], rows: dict) -> dict[str, int]:
    train = tokenized["train"].examples
    return {
        "records": total,
        "rejects": len(rejects),
        "train_examples": len(train),
        "eval_examples": len(tokenized["eval"].examples),
        "train_rows": len(rows["train"][0]),
        "eval_rows": len(rows["eval"][0]),
        "train_tokens": sum(len(ids) for ids, _ in train),
        "train_target_tokens": sum(sum(1 for x in lab if x != IGNORE_INDEX) for _, lab in train),
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
