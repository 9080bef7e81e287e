"""Staging throughput (tokens/s) side by side with a plain ``datasets.map(batched=True)`` tokenization.

    .venv/bin/python bench/staging_throughput.py [--records 200000]

Both tokenize the same generated input/target records with the same fast tokenizer. unbroken's number covers the
whole of staging (read, validate every record, tokenize, mask, pack, write Parquet shards + manifest); the
baseline only loads the JSONL and tokenizes. A ratio from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from ray_jobs.config import DataConfig
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import train_char_tokenizer


def make_data(path: Path, n: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randrange(10**6), rng.randrange(10**6)
            f.write(json.dumps({"input": f"What is {a} plus {b}? ", "target": f"The sum is {a + b}."}) + "\n")


def ours(src: Path, storage: Path, tok) -> tuple[float, int]:
    started = time.perf_counter()
    r = stage(DataConfig(train=str(src), seq_len=256, shard_mb=64, min_shards=2), tok, "builtin", str(storage))
    elapsed = time.perf_counter() - started
    tokens = r.manifest["counts"]["train_tokens"]  # eval rows are tokenized too; counting train only is conservative
    return elapsed, tokens


def baseline(src: Path, cache: Path, tok) -> tuple[float, int]:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    started = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(cache))

    def tokenize(batch):
        return {
            "prompt_ids": tok(batch["input"], add_special_tokens=False)["input_ids"],
            "target_ids": tok(batch["target"], add_special_tokens=False)["input_ids"],
        }

    out = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
    tokens = sum(len(p) + len(t) for p, t in zip(out["prompt_ids"], out["target_ids"], strict=True))
    return time.perf_counter() - started, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=200_000)
    args = p.parse_args()
    tok = train_char_tokenizer()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as d:
        src = Path(d) / "data.jsonl"
        make_data(src, args.records)
        b_s, b_tok = baseline(src, Path(d) / "hf-cache", tok)
        o_s, o_tok = ours(src, Path(d) / "storage", tok)
    print(json.dumps({"records": args.records, "baseline_s": round(b_s, 2), "baseline_tokens": b_tok,
                      "unbroken_s": round(o_s, 2), "unbroken_train_tokens": o_tok}))  # fmt: skip
    print(
        f"datasets.map(batched=True): {b_tok / b_s:,.0f} tokens/s (tokenize only); "
        f"unbroken staging: {o_tok / o_s:,.0f} tokens/s (validate+tokenize+pack+write) "
        f"-> ratio {(o_tok / o_s) / (b_tok / b_s):.2f}"
    )


if __name__ == "__main__":
    main()
