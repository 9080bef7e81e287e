"""Staging throughput (tokens/s) next to ``datasets.map(batched=True, num_proc=2)``, and where staging's time goes.

    .venv/bin/python bench/staging_throughput.py [--mb 100] [--corpus both|pairs|docs|doc] [--repeat 1]
                                                [--tokenizer smollm2|builtin] [--profile-mb 20] [--no-profile]

Two corpora of ``--mb`` MB each: instruction pairs (``bench/staging_memory.py``'s generator, ~600 bytes a record,
``format: pairs``) and long documents (``format: text``: word text, lengths log-uniform from 1 KB to ``--doc-max-mb``,
so most of the bytes are documents over ``WINDOW_CHARS``, encoded a window at a time and cut into pieces); or,
``--corpus doc``, one document of ``--mb`` MB in one JSONL line (``staging_memory.py --doc-mb``'s). Each is staged in
a fresh process (``data.workers`` default: one per core; ``seq_len`` 512, 1024 for the character tokenizer
``builtin``; a small separate eval file, so the train tokens counted are all of the input the baseline tokenizes)
and tokenized by the baseline in another:
``datasets.load_dataset("json")`` then ``.map(batched=True, num_proc=2)`` calling the tokenizer on the same columns
(``input`` and ``target``; ``text``). unbroken's time covers the whole staging (hash sources, read, validate every
record, tokenize with offsets, mask or cut, pack, spill, write Parquet shards + manifest); the baseline's covers load
and tokenize. Seconds are measured inside each process (imports and tokenizer load excluded), peak RSS over its
process tree. Then "where the time goes": one staging per corpus (``--profile-mb``) with ``data.workers=1`` in one
process (``TOKENIZERS_PARALLELISM=false``, as in a pool worker), its stages timed by wrapping the functions that run
them (exclusive time: a stage's callees are not counted twice). Measurements from one machine: each row says how many
cores other processes kept busy meanwhile (``others_cores``); ``--repeat`` measures each corpus again, in turn.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.staging_memory import BASELINE_DOC_MB, WORDS, make_data, make_doc, measured, tokenizer_path  # noqa: E402

SEQ_LEN = {"builtin": 1024}  # by tokenizer, else 512: a pair is up to ~650 characters, so as many builtin tokens


# -- the corpora
def doc_text(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of word text: sentences of 12 words, paragraphs of 8 sentences."""
    words = rng.choices(WORDS, k=chars // 4 + 16)
    sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    text = "\n\n".join(" ".join(sentences[i : i + 8]) for i in range(0, len(sentences), 8))
    return text[:chars].rsplit(" ", 1)[0]


def make_docs(path: Path, megabytes: float, seed: int = 0, max_mb: float = 4.0) -> int:
    """``text`` documents, lengths log-uniform from 1 KB to ``max_mb``, until the file holds ``megabytes``."""
    rng = random.Random(seed)
    lo, hi, n = math.log(1000), math.log(max_mb * 1e6), 0
    with path.open("w") as f:
        while f.tell() < megabytes * 1e6:
            f.write(json.dumps({"text": doc_text(rng, int(math.exp(rng.uniform(lo, hi))))}) + "\n")
            n += 1
    return n


def make_corpus(d: Path, corpus: str, megabytes: float, max_mb: float) -> tuple[Path, Path, int]:
    """(train file, small separate eval file, train records) of one corpus."""
    d.mkdir(parents=True, exist_ok=True)
    train, ev = d / f"{corpus}-{megabytes}.jsonl", d / f"{corpus}-eval.jsonl"
    if corpus == "pairs":
        n = make_data(train, megabytes)
        make_data(ev, 0.05, seed=1)  # about 100 records
    elif corpus == "doc":
        n = 1
        make_doc(train, megabytes)
        make_doc(ev, 0)
    else:
        n = make_docs(train, megabytes, max_mb=max_mb)
        make_docs(ev, 0.05, seed=1, max_mb=0.01)
    return train, ev, n


# -- what runs in a fresh process (``--child``)
def load_tok(cfg: dict):
    if cfg["tokenizer"] == "builtin":
        from ray_jobs.model.builtin import train_char_tokenizer

        return train_char_tokenizer(), "builtin"
    from ray_jobs.model.loading import load_tokenizer

    return load_tokenizer(cfg["tokenizer"]), cfg["tokenizer"]


def data_config(cfg: dict, workers: int):
    from ray_jobs.config import DataConfig

    seq_len = SEQ_LEN.get(cfg["tokenizer"], 512)
    return DataConfig(train=cfg["train"], eval=cfg["eval"], format=cfg["format"], seq_len=seq_len, shard_mb=64,
                      min_shards=2, workers=workers, work_dir=cfg["dir"] + "/work")  # fmt: skip


def child_ours(cfg: dict) -> dict:
    from ray_jobs.data.staging import stage
    from ray_jobs.data.workers import pool_size

    tok, name = load_tok(cfg)
    data = data_config(cfg, cfg["workers"])
    started = time.perf_counter()
    counts = stage(data, tok, name, cfg["dir"] + "/storage").manifest.counts
    secs = time.perf_counter() - started
    workers = pool_size(data, Path(cfg["train"]).stat().st_size + Path(cfg["eval"]).stat().st_size)
    return {"seconds": secs, "tokens": counts.train_tokens, "workers": workers,
            "pieces": counts.pieces, "cut_documents": counts.cut_documents}  # fmt: skip


def child_baseline(cfg: dict) -> dict:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    import pyarrow.compute as pc

    datasets.disable_progress_bars()
    tok, _ = load_tok(cfg)
    cols = ["input", "target"] if cfg["format"] == "pairs" else ["text"]

    def tokenize(batch):
        return {f"{c}_ids": tok(batch[c])["input_ids"] for c in cols}

    started = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=cfg["train"], split="train", cache_dir=cfg["dir"] + "/hf-cache")
    out = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)
    secs = time.perf_counter() - started
    tokens = sum(pc.sum(pc.list_value_length(out.data.column(f"{c}_ids"))).as_py() for c in cols)
    return {"seconds": secs, "tokens": tokens, "workers": 2}


def child_profile(cfg: dict) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in a pool worker: one thread
    from ray_jobs.data.staging import stage

    tok, name = load_tok(cfg)
    stages = Stages()
    instrument(stages, tok)
    started = time.perf_counter()
    stage(data_config(cfg, 1), tok, name, cfg["dir"] + "/storage")
    total = time.perf_counter() - started
    return {"total_s": total, "own_s": dict(stages.own), "calls": dict(stages.calls)}


# -- timing stages by wrapping the functions that run them
class Stages:
    """Exclusive seconds per label of wrapped calls (a callee's time is its own label's, not its caller's)."""

    def __init__(self):
        self.own: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # [started, seconds spent in wrapped callees]

    def _enter(self) -> None:
        self._stack.append([time.perf_counter(), 0.0])

    def _leave(self, label: str) -> None:
        started, inner = self._stack.pop()
        spent = time.perf_counter() - started
        self.own[label] += spent - inner
        self.calls[label] += 1
        if self._stack:
            self._stack[-1][1] += spent

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            self._enter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._leave(label)
            return self._each(label, out) if isinstance(out, types.GeneratorType) else out

        return timed

    def _each(self, label: str, gen):
        """A generator's work happens at each next(): time those."""
        while True:
            self._enter()
            try:
                item = next(gen)
            except StopIteration:
                return
            finally:
                self._leave(label)
            yield item


class TimedBackend:
    """The fast tokenizer's Rust backend with its encode calls timed; everything else passes through."""

    def __init__(self, real, stages: Stages):
        self._real = real
        self.encode = stages.wrap("tokenizer: Rust encode (ids+offsets)", real.encode)
        self.encode_batch = stages.wrap("tokenizer: Rust encode (ids+offsets)", real.encode_batch)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


# (label, where it runs with a pool: "worker" or "staging process", [(module, class or None, function)])
STAGES = [
    ("hash sources (sha256)", "staging process", [("staging", None, "resolve_hashes")]),
    ("read source bytes", "worker", [("workers", None, "read_range")]),
    ("parse JSON + validate records", "worker", [("workers", None, "batch_records")]),
    ("tokens to Python lists", "worker", [("tokenize", None, "_encode"), ("tokenize", None, "encode_records")]),
    ("pairs: mask + checks (numpy per record)", "worker", [("tokenize", "Tokenized", "__init__")]),
    ("text: window cuts + checks", "worker", [("documents", None, "window_tokens")]),
    ("text: cut into pieces", "worker", [("documents", None, "document_pieces"), ("documents", "Cutter", "feed"),
     ("documents", "Cutter", "finish"), ("documents", None, "_examples"), ("documents", "Documents", "__init__")]),
    ("text: pieces to side file", "worker", [("documents", "DocSink", "put"), ("documents", "DocSink", "close")]),
    ("split + other worker work", "worker", [("workers", "BatchWork", "__call__")]),
    ("text: pieces read back", "staging process", [("documents", "DocPieces", "read")]),
    ("pack rows", "staging process", [("pack", "Packer", "add"), ("pack", "Packer", "finish")]),
    ("spill rows + rejects", "staging process", [("spill", "Spill", "add"), ("spill", "Spill", "_rows"),
     ("spill", "Spill", "_rejects")]),
    ("progress + fsync", "staging process", [("spill", "Spill", "_save")]),
    ("read spill back", "staging process", [("spill", "Spill", "write_split")]),
    ("Parquet encode (zstd)", "staging process", [("pack", None, "parquet_bytes")]),
    ("write shard + sha256", "staging process", [("spill", None, "write_shard"), ("pack", None, "write_bytes_atomic")]),
]  # fmt: skip
WHERE = {label: where for label, where, _ in STAGES} | {"tokenizer: Rust encode (ids+offsets)": "worker"}


def instrument(stages: Stages, tok) -> None:
    import importlib

    for label, _, targets in STAGES:
        for module, cls, fn in targets:
            owner = importlib.import_module(f"ray_jobs.data.{module}")
            owner = getattr(owner, cls) if cls else owner
            setattr(owner, fn, stages.wrap(label, getattr(owner, fn)))
    tok._tokenizer = TimedBackend(tok._tokenizer, stages)


# -- the parent: corpora, fresh processes, tables
def measure(kind: str, cfg: dict) -> dict:
    """Run one measurement in a fresh process: its result, wall seconds, peak RSS of its process tree, and the
    cores other processes kept busy meanwhile (``others_cores``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--child", kind, "--cfg", json.dumps(cfg)]
    wall, peak, out, others = measured(cmd, env)
    got = json.loads(out.strip().splitlines()[-1])
    return {**got, "wall_s": wall, "peak_rss_mb": round(peak / 1e6), "others_cores": others}


def throughput(d: Path, corpus: str, args, tok: str) -> None:
    """unbroken's staging and the baseline on one corpus, ``--repeat`` times in turn; a row each, and the ratio."""
    train, ev, n = make_corpus(d, corpus, args.mb, args.doc_max_mb)
    kinds = {"ours": "unbroken stage", "baseline": "datasets.map num_proc=2"}
    if corpus == "doc" and args.mb > BASELINE_DOC_MB:  # whole, ~200 MB of peak per MB of text
        print(f"(no baseline: datasets.map tokenizes a document whole; over {BASELINE_DOC_MB} MB it would need GBs)")
        del kinds["baseline"]
    rate: dict[str, list[float]] = defaultdict(list)
    mb = round(train.stat().st_size / 1e6, 1)
    for rep in range(args.repeat):
        for kind, what in kinds.items():
            cfg = {"train": str(train), "eval": str(ev), "format": "pairs" if corpus == "pairs" else "text",
                   "tokenizer": tok, "workers": args.workers, "dir": str(d / f"{corpus}-{kind}-{rep}")}  # fmt: skip
            r = measure(kind, cfg)
            rate[kind].append(r["tokens"] / r["seconds"])
            row = {"corpus": corpus, "what": what, "run": rep + 1, "mb": mb, "records": n, "workers": r["workers"],
                   "seconds": round(r["seconds"], 1), "wall_s": round(r["wall_s"], 1), "tokens": r["tokens"],
                   "tokens_per_s": round(rate[kind][-1]), "peak_rss_mb": r["peak_rss_mb"],
                   "others_cores": r["others_cores"]}  # fmt: skip
            print(json.dumps(row), flush=True)
    if "baseline" in kinds:
        ratios = [o / b for o, b in zip(rate["ours"], rate["baseline"], strict=True)]
        med = {k: statistics.median(v) for k, v in rate.items()}
        print(f"{corpus}: unbroken staging / datasets.map(batched=True, num_proc=2) tokens/s = "
              f"{', '.join(f'{x:.2f}' for x in ratios)}x (median {statistics.median(ratios):.2f}x; median tokens/s "
              f"{med['ours']:,.0f} vs {med['baseline']:,.0f})\n", flush=True)  # fmt: skip


def breakdown(d: Path, corpus: str, args, tok: str) -> None:
    """One staging with data.workers=1, its stages timed; printed as shares of its time."""
    train, ev, _ = make_corpus(d / "profile", corpus, args.profile_mb, args.doc_max_mb)
    cfg = {"train": str(train), "eval": str(ev), "format": "pairs" if corpus == "pairs" else "text",
           "tokenizer": tok, "workers": 1, "dir": str(d / f"{corpus}-profile")}  # fmt: skip
    r = measure("profile", cfg)
    total, own = r["total_s"], r["own_s"]
    own["other (setup, manifest, rest)"] = total - sum(own.values())
    print(f"where the time goes: {corpus}, {args.profile_mb} MB, data.workers=1, {total:.1f} s, peak RSS "
          f"{r['peak_rss_mb']} MB (others kept {r['others_cores']} cores busy)")  # fmt: skip
    by_where: dict[str, float] = defaultdict(float)
    for label, secs in sorted(own.items(), key=lambda kv: -kv[1]):
        where = WHERE.get(label, "staging process")
        by_where[where] += secs
        print(f"  {label:<42} {secs:8.2f} s {100 * secs / total:5.1f} %  ({where}, {r['calls'].get(label, 0)} calls)")
    print("  with a pool: " + ", ".join(f"{w} {100 * s / total:.0f} %" for w, s in by_where.items()) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=100, help="size of each corpus's train file")
    p.add_argument("--corpus", choices=["both", "pairs", "docs", "doc"], default="both", help="doc: one document")
    p.add_argument("--tokenizer", default="smollm2", help="smollm2 (SmolLM2's BPE) or builtin (characters)")
    p.add_argument("--repeat", type=int, default=1, help="measure each this many times, in turn")
    p.add_argument("--workers", type=int, default=0, help="data.workers (0: one per core)")
    p.add_argument("--doc-max-mb", type=float, default=4.0, help="longest document of the docs corpus")
    p.add_argument("--profile-mb", type=float, default=20, help="size of the corpora the breakdown stages")
    p.add_argument("--no-profile", action="store_true", help="no breakdown")
    p.add_argument("--profile-only", action="store_true", help="the breakdown alone")
    p.add_argument("--child", choices=["ours", "baseline", "profile"], help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps({"ours": child_ours, "baseline": child_baseline, "profile": child_profile}[args.child](
            json.loads(args.cfg))))  # fmt: skip
        return
    tok = "builtin" if args.tokenizer == "builtin" else tokenizer_path()
    corpora = ["pairs", "docs"] if args.corpus == "both" else [args.corpus]
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} cores, tokenizer {args.tokenizer}\n")
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        d = Path(tmp)
        for corpus in corpora if not args.profile_only else []:
            throughput(d, corpus, args, tok)
        for corpus in corpora if not args.no_profile else []:
            breakdown(d, corpus, args, tok)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
