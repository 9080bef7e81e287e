"""How long does a checkpoint block training? Async (background write) vs synchronous, same state, same run.

    .venv/bin/python bench/checkpoint_stall.py [--hidden 512 --layers 8 --steps 40 --every 10]

Trains the built-in Llama at a size where a checkpoint is a few hundred MB, in-process (the same Trainer the Ray
job runs), once with ``checkpoint.async_write=true`` and once with ``false``, and reports the training-thread time
blocked per periodic checkpoint. The final checkpoint (always synchronous) is left out of both. A ratio from one
run on one machine, not an absolute number: it is what to compare across changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ray_jobs.config import load_config
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.train.runtime import LocalRuntime
from ray_jobs.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def run(args, async_write: bool, storage: Path) -> dict:
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [
            f"name=bench-{'async' if async_write else 'sync'}",
            f"storage={storage}",
            f"data.cache_dir={storage}/cache",
            f"model.tiny.hidden_size={args.hidden}",
            f"model.tiny.num_layers={args.layers}",
            f"model.tiny.num_heads={args.hidden // 64}",
            f"model.tiny.intermediate_size={args.hidden * 4}",
            "train.micro_batch_size=4",
            f"train.max_steps={args.steps}",
            f"train.eval_every_steps={args.steps}",
            "train.eval_max_batches=1",
            f"checkpoint.every_steps={args.every}",
            f"checkpoint.async_write={str(async_write).lower()}",
        ],
    )
    model = storage / "base"
    if not model.exists():
        build_builtin(cfg.model, cfg.train.seed, model)
    manifest = stage(cfg.data, load_tokenizer(str(model)), str(model), cfg.storage).manifest
    t = Trainer(cfg, manifest, str(model), LocalRuntime())
    t.resume_or_start()
    started = time.monotonic()
    t.fit()
    periodic = t.stalls_s[:-1]
    ckpt_dir = Path(cfg.storage) / "ray" / cfg.name
    size = sum(p.stat().st_size for p in next(ckpt_dir.glob("checkpoint-step-*")).iterdir())
    return {
        "mode": "async" if async_write else "sync",
        "checkpoint_mb": round(size / 1e6, 1),
        "periodic_checkpoints": len(periodic),
        "blocked_s_mean": round(statistics.mean(periodic), 4),
        "blocked_s_max": round(max(periodic), 4),
        "run_s": round(time.monotonic() - started, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as d:
        rows = [run(args, mode, Path(d)) for mode in (False, True)]
    sync, asyn = rows
    for r in rows:
        print(json.dumps(r))
    print(
        f"blocked per checkpoint: sync {sync['blocked_s_mean'] * 1000:.0f} ms, async {asyn['blocked_s_mean'] * 1000:.0f} ms "
        f"-> async blocks {sync['blocked_s_mean'] / asyn['blocked_s_mean']:.1f}x less ({sync['checkpoint_mb']} MB checkpoints)"
    )


if __name__ == "__main__":
    main()
