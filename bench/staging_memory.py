"""Staging's peak memory against dataset size, and its throughput next to ``datasets.map(batched=True, num_proc=2)``.

    .venv/bin/python bench/staging_memory.py [--small-mb 100] [--large-mb 1000] [--skip-baseline]

Generates instruction-style JSONL pairs (about 600 bytes a record, like the seeds' shards) of two sizes and stages
each in a fresh process with a real BPE tokenizer (SmolLM2's, built by ``make smollm2``). Peak RSS is sampled over the
staging process and its worker processes together (their sum), every 50 ms. The baseline loads the same small file
with ``datasets.load_dataset("json")`` and tokenizes prompt and target with ``.map(batched=True, num_proc=2)``; its
own peak is measured the same way. Ratios from one run on one machine; the goal (issue 13): large/small peak <= 1.3,
peak <= 2 GB, throughput >= 1.5x the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
    src, storage, tok = sys.argv[1:4]
    data = DataConfig(train=src, seq_len=512, shard_mb=64, min_shards=2, work_dir=storage + "-work")
    r = stage(data, load_tokenizer(tok), tok, storage)
    print(json.dumps(r.manifest["counts"]))
"""

BASELINE = """
import json, os, sys
os.environ["HF_DATASETS_OFFLINE"] = "1"
import datasets
from transformers import AutoTokenizer
if __name__ == "__main__":
    src, cache, tok_path = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(tok_path)
    ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)
    def tokenize(batch):
        return {"prompt_ids": tok(batch["input"])["input_ids"], "target_ids": tok(batch["target"])["input_ids"]}
    out = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)
    tokens = sum(len(p) + len(t) for p, t in zip(out["prompt_ids"], out["target_ids"]))
    print(json.dumps({"tokens": tokens}))
"""


def tokenizer_path() -> str:
    sys.path.insert(0, str(ROOT))
    from tests.models import smollm2

    return str(smollm2())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small-mb", type=int, default=100)
    p.add_argument("--large-mb", type=int, default=1000)
    p.add_argument("--skip-baseline", action="store_true")
    args = p.parse_args()
    tok = tokenizer_path()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as d:
        for mb in (args.small_mb, args.large_mb):
            src = Path(d) / f"data-{mb}.jsonl"
            records = make_data(src, mb)
            secs, peak, out = peak_rss([sys.executable, "-c", STAGE, str(src), f"{d}/storage-{mb}", tok], env)
            counts = json.loads(out.strip().splitlines()[-1])
            rows.append({"what": f"unbroken stage {mb} MB", "records": records, "seconds": round(secs, 1),
                         "peak_rss_mb": round(peak / 1e6), "tokens": counts["train_tokens"],
                         "tokens_per_s": round(counts["train_tokens"] / secs)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        if not args.skip_baseline:
            src = Path(d) / f"data-{args.small_mb}.jsonl"
            secs, peak, out = peak_rss([sys.executable, "-c", BASELINE, str(src), f"{d}/hf-cache", tok], env)
            tokens = json.loads(out.strip().splitlines()[-1])["tokens"]
            rows.append({"what": f"datasets.map num_proc=2 {args.small_mb} MB", "seconds": round(secs, 1),
                         "peak_rss_mb": round(peak / 1e6), "tokens": tokens, "tokens_per_s": round(tokens / secs)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    small, large = rows[0], rows[1]
    print(f"\npeak RSS {args.large_mb} MB / {args.small_mb} MB: {large['peak_rss_mb'] / small['peak_rss_mb']:.2f}x "
          f"(goal <= 1.3); largest peak {max(small['peak_rss_mb'], large['peak_rss_mb'])} MB (goal <= 2000)")  # fmt: skip
    if not args.skip_baseline:
        ratio = small["tokens_per_s"] / rows[2]["tokens_per_s"]
        print(f"throughput vs datasets.map(batched=True, num_proc=2): {ratio:.2f}x (goal >= 1.5; unbroken's time "
              "covers validate+tokenize+mask+pack+write shards, the baseline's load+tokenize)")  # fmt: skip


if __name__ == "__main__":
    main()
