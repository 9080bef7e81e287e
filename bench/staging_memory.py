"""Staging's peak memory against dataset size, and its throughput next to ``datasets.map(batched=True, num_proc=2)``.

    .venv/bin/python bench/staging_memory.py [--small-mb 100] [--large-mb 1000] [--skip-baseline]
                                             [--doc-mb 100] [--cluster]

Generates instruction-style JSONL pairs (about 600 bytes a record, like the seeds' shards) of two sizes and stages
each in a fresh process with a real BPE tokenizer (SmolLM2's, built by ``make smollm2``). Peak RSS is sampled over the
staging process and its worker processes together (their sum), every 50 ms. The baseline loads the same small file
with ``datasets.load_dataset("json")`` and tokenizes prompt and target with ``.map(batched=True, num_proc=2)``; its
own peak is measured the same way. Ratios from one run on one machine; the goal (issue 13): large/small peak <= 1.3,
peak <= 2 GB, throughput >= 1.5x the baseline.

``--doc-mb``: one ``text`` document of that many MB of word text in one JSONL line (``seq_len`` 512, a small separate
eval file), staged the same way, and one of 1 MB for the fixed cost (interpreter, tokenizer, workers): the peak each
MB of text adds. The goal (issue 27): memory a small multiple of the text (the JSON line and its decoded string) plus
one window of ``WINDOW_CHARS``, not proportional to its tokens. The baseline tokenizes such a line with
``datasets.map`` too (the whole document in one call; at most ``BASELINE_DOC_MB`` of it). ``--cluster``: also stage
the documents with ``on="cluster"`` on a Ray instance started in the staging process (``address="local"``, no
dashboard, its own temp folder): the sum then includes Ray's own processes, and pages of Ray's shared-memory object
store count in every process that maps them. ``--small-mb 0 --large-mb 0``: the documents alone. Every row says how
many cores other processes on the machine kept busy meanwhile (``others_cores``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
_TEXT = (
    "the of and to in is that for it as with was on be by this are from or have an they which one you were all we "
    "her she there would their will when who him been has more if no out so what up said about into than them can "
    "only other time new some could these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right"
)
WORDS = _TEXT.split()
BASELINE_DOC_MB = 20  # the baseline tokenizes a document whole: ~200 MB of peak per MB of text


def make_data(path: Path, megabytes: int, seed: int = 0) -> int:
    """Instruction pairs until the file holds ``megabytes`` MB; returns the record count."""
    rng = random.Random(seed)
    target, n = megabytes * 1_000_000, 0
    with path.open("w") as f:
        while f.tell() < target:
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(40, 80))).capitalize() + "?\n"
            answer = " ".join(rng.choices(WORDS, k=rng.randint(20, 50))).capitalize() + "."
            f.write(json.dumps({"input": f"Question {n}: {prompt}", "target": answer}) + "\n")
            n += 1
    return n


def make_doc(path: Path, megabytes: int, seed: int = 0) -> int:
    """One document of about ``megabytes`` MB of word text as one JSONL line, written a paragraph batch at a time;
    returns its characters."""
    rng = random.Random(seed)
    chars = 0
    with path.open("w") as f:
        f.write('{"text": "')
        while not chars or chars < megabytes * 1_000_000:  # at least one batch: 0 MB is one small document
            words = rng.choices(WORDS, k=9600)  # 100 paragraphs of 8 sentences of 12 words
            sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
            text = "".join(" ".join(sentences[i : i + 8]) + "\n\n" for i in range(0, len(sentences), 8))
            f.write(json.dumps(text)[1:-1])
            chars += len(text)
        f.write('"}\n')
    return chars


def peak_rss(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds, peak RSS in bytes of the process tree, stdout) of running ``cmd``."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    peak = [0]

    def sample() -> None:
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [p, *p.children(recursive=True)]
                peak[0] = max(peak[0], sum(c.memory_info().rss for c in tree if c.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()
    t.join()
    if proc.returncode:
        raise SystemExit(f"{cmd} failed ({proc.returncode})")
    return time.perf_counter() - started, peak[0], out


STAGE = """
import json, sys
from ray_jobs.config import DataConfig
from ray_jobs.data.staging import stage
from ray_jobs.model.loading import load_tokenizer
if __name__ == "__main__":
    src, storage, tok, fmt, ev = (sys.argv[1:] + ["pairs", ""])[:5]
    data = DataConfig(train=src, eval=ev or None, format=fmt, seq_len=512, shard_mb=64, min_shards=2,
                      work_dir=storage + "-work")
    r = stage(data, load_tokenizer(tok), tok, storage)
    print(r.manifest.counts.model_dump_json())
"""

STAGE_CLUSTER = """
import json, os, sys, psutil, ray
from ray_jobs.config import DataConfig
from ray_jobs.data.staging import stage
from ray_jobs.model.loading import load_tokenizer
if __name__ == "__main__":
    src, storage, tok, fmt, ev, tmp = sys.argv[1:7]
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=tmp,
             object_store_memory=2 * 10**9, log_to_driver=False)
    me = psutil.Process()
    idle = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
    data = DataConfig(train=src, eval=ev, format=fmt, seq_len=512, shard_mb=64, min_shards=2,
                      work_dir=storage + "-work")
    r = stage(data, load_tokenizer(tok), tok, storage, on="cluster")
    ray.shutdown()
    print(json.dumps({**r.manifest.counts.model_dump(), "ray_idle_rss": idle}))
"""

BASELINE = """
import json, os, sys
os.environ["HF_DATASETS_OFFLINE"] = "1"
import datasets
from transformers import AutoTokenizer
if __name__ == "__main__":
    src, cache, tok_path, cols = (sys.argv[1:] + ["input,target"])[:4]
    tok = AutoTokenizer.from_pretrained(tok_path)
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)
    def tokenize(batch):
        return {c + "_ids": tok(batch[c])["input_ids"] for c in cols.split(",")}
    out = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)
    import pyarrow.compute as pc  # counted in Arrow: a Python list of every token would add its own memory
    tokens = sum(pc.sum(pc.list_value_length(out.data.column(c + "_ids"))).as_py() for c in cols.split(","))
    print(json.dumps({"tokens": tokens}))
"""


def tokenizer_path() -> str:
    sys.path.insert(0, str(ROOT))
    from tests.models import smollm2

    return str(smollm2())


def busy_cpu_s() -> tuple[float, float]:
    """(CPU seconds every process on this machine has used, CPU seconds this process and its reaped descendants
    have): their difference over a measurement is what other people's processes took meanwhile."""
    t = psutil.cpu_times()
    mine = [*resource.getrusage(resource.RUSAGE_SELF)[:2], *resource.getrusage(resource.RUSAGE_CHILDREN)[:2]]
    return sum(t) - t.idle - getattr(t, "iowait", 0.0), sum(mine)


def measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str, float]:
    """``peak_rss``, and the cores other processes on this machine kept busy meanwhile (on average)."""
    all0, mine0 = busy_cpu_s()
    secs, peak, out = peak_rss(cmd, env)
    all1, mine1 = busy_cpu_s()
    return secs, peak, out, round(max(0.0, (all1 - all0) - (mine1 - mine0)) / secs, 2)


def run(script: str, argv: list[str], env: dict[str, str], what: str, **extra) -> dict:
    """One staging (or baseline) in a fresh process: a printed row of its seconds, peak RSS and tokens."""
    secs, peak, out, others = measured([sys.executable, "-c", script, *argv], env)
    got = json.loads(out.strip().splitlines()[-1])
    tokens = got.get("train_tokens", got.get("tokens"))
    row = {"what": what, **extra, "seconds": round(secs, 1), "peak_rss_mb": round(peak / 1e6), "tokens": tokens,
           "tokens_per_s": round(tokens / secs), "others_cores": others}  # fmt: skip
    if "ray_idle_rss" in got:
        row["ray_idle_rss_mb"] = round(got["ray_idle_rss"] / 1e6)
    print(json.dumps(row), flush=True)
    return row


def pairs_cases(d: str, args, tok: str, env: dict[str, str]) -> None:
    """The two sizes of instruction pairs, and the baseline on the small one; their summary."""
    rows = []
    for mb in (args.small_mb, args.large_mb):
        src = Path(d) / f"data-{mb}.jsonl"
        records = make_data(src, mb)
        rows.append(run(STAGE, [str(src), f"{d}/storage-{mb}", tok], env, f"unbroken stage {mb} MB", records=records))
    if not args.skip_baseline:
        src = str(Path(d) / f"data-{args.small_mb}.jsonl")
        rows.append(run(BASELINE, [src, f"{d}/hf-cache", tok], env, f"datasets.map num_proc=2 {args.small_mb} MB"))
    small, large = rows[0], rows[1]
    print(f"\npeak RSS {args.large_mb} MB / {args.small_mb} MB: {large['peak_rss_mb'] / small['peak_rss_mb']:.2f}x "
          f"(goal <= 1.3); largest peak {max(small['peak_rss_mb'], large['peak_rss_mb'])} MB (goal <= 2000)")  # fmt: skip
    if not args.skip_baseline:
        ratio = small["tokens_per_s"] / rows[2]["tokens_per_s"]
        print(f"throughput vs datasets.map(batched=True, num_proc=2): {ratio:.2f}x (goal >= 1.5; unbroken's time "
              "covers validate+tokenize+mask+pack+write shards, the baseline's load+tokenize)\n")  # fmt: skip


def doc_cases(d: str, args, tok: str, env: dict[str, str]) -> None:
    """One document of ``--doc-mb`` MB, and of 1 MB (the fixed cost: interpreter, tokenizer, workers): staged here
    (and on a local Ray instance with ``--cluster``), and through the baseline (at most ``BASELINE_DOC_MB``: whole,
    a document takes ~200 MB per MB of text there); the peak each MB of text adds."""
    ev = Path(d) / "doc-eval.jsonl"
    make_doc(ev, 0)  # 100 paragraphs, about 45 KB
    kinds = [("unbroken stage", STAGE, ["text", str(ev)], args.doc_mb)]
    if args.cluster:
        kinds.append(("unbroken stage on=cluster (local Ray)", STAGE_CLUSTER, ["text", str(ev), ""], args.doc_mb))
    if not args.skip_baseline:
        kinds.append(("datasets.map", BASELINE, ["text"], min(args.doc_mb, BASELINE_DOC_MB)))
    sizes = {mb: make_doc(Path(d) / f"doc-{mb}.jsonl", mb) / 1e6 for mb in {1, *(k[3] for k in kinds)}}
    print(f"\none document: {sizes[args.doc_mb]:.1f} MB of text, its JSONL line "
          f"{(Path(d) / f'doc-{args.doc_mb}.jsonl').stat().st_size / 1e6:.1f} MB")  # fmt: skip
    for n, (what, script, tail, top) in enumerate(kinds):
        rows = {}
        for mb in (1, top):
            tmp = tempfile.mkdtemp(prefix="ub-ray-")  # short: Ray's socket paths live under it
            argv = [str(Path(d) / f"doc-{mb}.jsonl"), f"{d}/out-{n}-{mb}", tok, *tail[:2], *([tmp] if tail[2:] else [])]
            rows[mb] = run(script, argv, env, f"{what}: one {mb} MB document")
            shutil.rmtree(tmp, ignore_errors=True)
        big, one = rows[top], rows[1]
        slope = (big["peak_rss_mb"] - one["peak_rss_mb"]) / (sizes[top] - sizes[1])
        print(f"  -> {what}: peak {big['peak_rss_mb']} MB for {sizes[top]:.0f} MB of text, {one['peak_rss_mb']} MB "
              f"for 1 MB: {slope:.1f} MB of peak per MB of text; {big['seconds']} s\n", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small-mb", type=int, default=100)
    p.add_argument("--large-mb", type=int, default=1000)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--doc-mb", type=int, default=100, help="one text document of this many MB (0: none)")
    p.add_argument("--cluster", action="store_true", help="also stage the document on a local Ray instance")
    args = p.parse_args()
    tok = tokenizer_path()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as d:
        if args.small_mb and args.large_mb:
            pairs_cases(d, args, tok, env)
        if args.doc_mb:
            doc_cases(d, args, tok, env)


if __name__ == "__main__":
    main()
