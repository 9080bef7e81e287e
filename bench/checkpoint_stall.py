"""How long does a checkpoint block training, and how much does a rank read to resume? Sharded FSDP checkpoints on
two ranks (gloo, CPU), async (each rank writes its part on a background thread) against synchronous, same runs.

    .venv/bin/python bench/checkpoint_stall.py [--models 33m,smollm2] [--steps 8 --every 2]

Models: ``33m``, the built-in Llama at 33 M parameters, and ``smollm2``, the real SmolLM2-135M-Instruct (full
fine-tune, fp32: a 1.6 GB checkpoint with Adam state; built by ``make smollm2``). Each runs the same Trainer the Ray
job runs, on ``torch.distributed`` with two processes, once with ``checkpoint.async_write=false`` and once with
``true``; the training-thread time blocked per periodic checkpoint is averaged (the final checkpoint, always
synchronous, is left out). Then a third start resumes from the newest checkpoint and each rank reports the bytes it
read, next to the checkpoint's shared bytes and its total. Ratios from one run on one machine; the goals (issue 13):
async stall <= 5 % of the synchronous save; resume bytes per rank <= shared + (total - shared) / world.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_jobs import checkpoint as ckpt  # noqa: E402
from ray_jobs.config import load_config  # noqa: E402
from ray_jobs.data.staging import stage  # noqa: E402
from ray_jobs.model.builtin import build_builtin  # noqa: E402
from ray_jobs.model.loading import load_tokenizer  # noqa: E402
from ray_jobs.storage import Layout  # noqa: E402
from tests.unit.dist_runs import run_world, train_rank  # noqa: E402

WORLD = 2
MODELS = {  # overrides on configs/demo.yaml
    "33m": {"model.tiny.hidden_size": 512, "model.tiny.num_layers": 8, "model.tiny.num_heads": 8,
            "model.tiny.intermediate_size": 2048, "data.seq_len": 128, "train.micro_batch_size": 4},
    "smollm2": {"data.seq_len": 64, "train.micro_batch_size": 1},
}  # fmt: skip


def config(storage: Path, kind: str, name: str, args, async_write: bool, model_path: str | None):
    overrides = {
        "name": name, "storage": str(storage), "data.cache_dir": f"{storage}/cache", "data.min_shards": WORLD,
        "data.work_dir": f"{storage}/work", "cluster.num_workers": WORLD, "cluster.cpus_per_worker": 1,
        "train.parallelism": "fsdp", "train.max_steps": args.steps, "train.eval_every_steps": 10**6,
        "train.eval_max_batches": 1, "train.warmup_steps": 0, "checkpoint.every_steps": args.every,
        "checkpoint.async_write": str(async_write).lower(), **MODELS[kind],
    }  # fmt: skip
    if model_path:
        overrides["model.name_or_path"] = model_path
    return load_config(ROOT / "configs" / "demo.yaml", [f"{k}={v}" for k, v in overrides.items()])


def base_model(kind: str, storage: Path) -> str:
    if kind == "smollm2":
        from tests.models import smollm2

        return str(smollm2())
    cfg = config(storage, kind, "base", argparse.Namespace(steps=1, every=1), False, None)
    path = storage / "base-33m"
    if not path.exists():
        build_builtin(cfg.model, cfg.train.seed, path)
    return str(path)


def measure(kind: str, args, storage: Path) -> dict:
    model = base_model(kind, storage)
    out: dict = {"model": kind}
    for mode in (False, True):
        cfg = config(storage, kind, f"{kind}-{'async' if mode else 'sync'}", args, mode, model)
        manifest = stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest
        ranks = run_world(train_rank, WORLD, cfg, manifest, model, None)
        periodic = [s for r in ranks for s in r["stalls_s"][:-1]]
        out["async_stall_s" if mode else "sync_stall_s"] = round(statistics.mean(periodic), 4)
    newest = ckpt.list_checkpoints(Layout(cfg.storage).checkpoints_dir(cfg.name))[0][1]
    files = ckpt.read_manifest(newest).files
    out["checkpoint_mb"] = round(sum(m.bytes for m in files.values()) / 1e6, 1)
    out["shared_mb"] = round(sum(m.bytes for n, m in files.items() if ckpt.owner(n) is None) / 1e6, 3)
    # one more step from the newest checkpoint: what did each rank read to resume?
    cfg.train.max_steps += 1
    ranks = run_world(train_rank, WORLD, cfg, manifest, model, None)
    out["resume_read_mb_per_rank"] = [round(r["bytes_resumed"] / 1e6, 1) for r in ranks]
    out["stall_ratio"] = round(out["async_stall_s"] / out["sync_stall_s"], 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="33m,smollm2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as d:
        for kind in args.models.split(","):
            rows.append(measure(kind, args, Path(d) / kind))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| model | checkpoint | sync stall | async stall | async/sync | resume read per rank (shared) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        per_rank = " / ".join(f"{x} MB" for x in r["resume_read_mb_per_rank"])
        print(f"| {r['model']} | {r['checkpoint_mb']} MB | {r['sync_stall_s'] * 1000:.0f} ms | "
              f"{r['async_stall_s'] * 1000:.0f} ms | {r['stall_ratio']:.1%} | {per_rank} ({r['shared_mb']} MB) |")  # fmt: skip


if __name__ == "__main__":
    main()
