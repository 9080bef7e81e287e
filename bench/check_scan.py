"""How fast does ``unbroken check`` read every record? Two measurements, each in a fresh process:

1. the scan alone (control/check/scan.py: every record read, validated and tokenized by staging's own workers, in a
   pool of processes once the data is big enough) over ~``--mb`` MB of generated ``pairs`` JSONL in a temporary
   folder, after the run's tokenizer is loaded: seconds, records/s, MB/s;
2. the whole ``unbroken check`` command (model, data, cluster, storage, plan) on a 1,000-line file whose 500th line
   is not JSON: its exit code (2), whether it names ``file:500``, and its wall time from process start.

    .venv/bin/python bench/check_scan.py [--mb 100] [--model builtin:tiny-llama|PATH] [--seq-len 128]

The records are prompt/target pairs of 4-14 common English words each (about 100 bytes a line), all within
``--seq-len`` tokens of the demo's character tokenizer, so the scan finds nothing to reject. The demo's config with
``data.train`` pointed at them; ``--model`` another model's tokenizer (a HF folder) instead.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import record  # noqa: E402

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
]
PORTS = ["cluster.dashboard_port=8597", "cluster.head_port=6597"]  # nothing answers there: no cluster is touched


def write_pairs(path: Path, mb: float, bad_line: int | None = None) -> int:
    """~``mb`` MB of pairs (or, with ``bad_line``, 1,000 lines, that one not JSON); the records written."""
    rng, n = random.Random(0), 0
    with path.open("w") as f:
        while (f.tell() < mb * 1e6) if bad_line is None else n < 1000:
            n += 1
            if n == bad_line:
                f.write('{"input": "an unterminated string\n')
                continue
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(4, 14)))
            target = " ".join(rng.choices(WORDS, k=rng.randint(4, 14)))
            f.write(json.dumps({"input": prompt + "\n", "target": target}) + "\n")
    return n


def sets(root: Path, train: Path, args: argparse.Namespace) -> list[str]:
    model = [] if args.model == "builtin:tiny-llama" else [f"model.name_or_path={args.model}"]
    return [f"storage={root / 'storage'}", f"data.train={train}", f"data.seq_len={args.seq_len}", *PORTS, *model]


def scan_alone(root: Path, train: Path, args: argparse.Namespace) -> dict:
    """The scan's figures, measured in a fresh process (its tokenizer loaded first, outside the timing)."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
from control.check import scan
from ray_jobs.config import load_config
cfg = load_config({str(ROOT / "configs" / "demo.yaml")!r}, {sets(root, train, args)!r})
tok = scan.load_tokenizer(cfg)
t = time.perf_counter()
s = scan.scan(cfg, tok, cfg.model.name_or_path)
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "records": s.counts["records"], "rejects": s.counts["rejects"],
                  "tokens": sum(x.tokens for x in s.sources), "bytes": sum(x.bytes for x in s.sources),
                  "workers": s.workers}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"the scan failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bad_line_check(root: Path, args: argparse.Namespace) -> dict:
    """``unbroken check`` on a file whose 500th line is bad, from process start to exit."""
    bad = root / "bad.jsonl"
    write_pairs(bad, 0, bad_line=500)
    argv = [sys.executable, "-m", "unbroken", "check", str(ROOT / "configs" / "demo.yaml")]
    argv += [a for s in sets(root, bad, args) for a in ("--set", s)]
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t
    return {"exit": r.returncode, "names_line": f"{bad}:500:" in r.stdout, "seconds": seconds, "out": r.stdout}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--model", default="builtin:tiny-llama", help="whose tokenizer: the demo's, or a HF folder")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="check-scan-bench-") as tmp:
        root = Path(tmp)
        train = root / "pairs.jsonl"
        written = write_pairs(train, args.mb)
        s = scan_alone(root, train, args)
        assert s["records"] == written, (s, written)
        print(
            f"scan: {s['bytes'] / 1e6:.1f} MB, {s['records']:,} records ({s['rejects']} rejected), "
            f"{s['tokens']:,} tokens in {s['seconds']:.2f} s with {s['workers']} process(es): "
            f"{s['records'] / s['seconds']:,.0f} records/s, {s['bytes'] / 1e6 / s['seconds']:.1f} MB/s, "
            f"{s['tokens'] / s['seconds']:,.0f} tokens/s",
            flush=True,
        )
        b = bad_line_check(root, args)
        print(
            f"bad line 500: exit {b['exit']}, names file:500: {b['names_line']}, {b['seconds']:.2f} s (whole command)"
        )
        print("\n".join("  " + line for line in b["out"].splitlines()))
    figures = {
        "mb": round(s["bytes"] / 1e6, 1),
        "model": args.model,
        "seconds": round(s["seconds"], 2),
        "records_per_s": round(s["records"] / s["seconds"]),
        "mb_per_s": round(s["bytes"] / 1e6 / s["seconds"], 2),
        "workers": s["workers"],
        "bad_line_exit": b["exit"],
        "bad_line_named": b["names_line"],
        "bad_line_s": round(b["seconds"], 2),
    }
    record("check_scan" + ("" if args.model == "builtin:tiny-llama" else "_model"), figures)


if __name__ == "__main__":
    main()
