"""P1: what does unbroken's fault tolerance cost in training speed? Its Ray Train job vs a bare DDP loop.

    .venv/bin/python bench/ddp_throughput.py [--steps 20 --warmup 2 --repeats 2 --seq-len 128 --micro-batch 2] [--full]

Both sides train the real model (SmolLM2-135M-Instruct, ``make smollm2``) with the chat recipe
(configs/smollm2-chat-lora.yaml: LoRA all-linear; ``--full`` for a full fine-tune) on the same staged shards, 2
gloo ranks of one CPU thread each, the same micro-batch, rows, steps, optimizer and deterministic kernels:

- **unbroken**: the real job (``ray_jobs.job.build_trainer`` -> Ray Train ``TorchTrainer`` -> the Trainer loop
  with its per-step agreement all-reduce, heartbeat thread and metrics log) on a fresh local Ray instance;
- **bare**: ``torch.multiprocessing`` + ``init_process_group("gloo")`` + ``DistributedDataParallel``, forward,
  backward, clip, AdamW: nothing else;
- **loop without Ray** (reported, not part of the ratio): unbroken's same Trainer loop on that plain process group
  (a Runtime over ``torch.distributed``), which splits the gap into what the loop costs and what running under
  Ray costs (its controller, actors, raylet and GCS share the machine's cores with the workers).

Tokens/s is taken over the same window on both sides: the steps after ``--warmup`` up to the one before the last
(the last step of the unbroken run also evaluates and checkpoints). Periodic checkpoints and evals are off: their
cost is measured by bench/checkpoint_stall.py. Reported: both rates and their ratio (target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_jobs.config import Config, from_json, load_config  # noqa: E402
from ray_jobs.contracts.dataset import DatasetManifest  # noqa: E402
from ray_jobs.data.cache import ShardCache  # noqa: E402
from ray_jobs.data.reading import Cursor, RankSampler, open_rows, rank_shards  # noqa: E402
from ray_jobs.data.staging import stage  # noqa: E402
from ray_jobs.model.loading import load_tokenizer  # noqa: E402

RECIPE = ROOT / "configs" / "smollm2-chat-lora.yaml"
WORLD = 2


def bench_config(args, storage: Path, model: Path) -> Config:
    sets = {
        "name": "bench-p1",
        "storage": storage,
        "data.cache_dir": storage / "cache",
        "model.name_or_path": model,
        "data.seq_len": args.seq_len,
        "train.micro_batch_size": args.micro_batch,
        "train.max_steps": args.steps,
        "train.warmup_steps": 0,
        "train.lr_schedule": "constant",
        "train.eval_every_steps": args.steps + 1,  # only the step-0 and final evals, outside the window
        "train.eval_max_batches": 1,
        "train.log_every_steps": 1,
        "checkpoint.every_steps": 0,
        "cluster.num_workers": WORLD,
    }
    if args.full:
        sets |= {"model.lora": "null", "train.lr": 5e-5}
    return load_config(RECIPE, [f"{k}={v}" for k, v in sets.items()])


def window_rate(rows: list[dict], first: int, last: int) -> float:
    """Tokens/s between the ends of steps ``first`` and ``last`` (from the unbroken run's metrics.jsonl)."""
    at = {r["step"]: r for r in rows if "tokens_seen" in r}
    return (at[last]["tokens_seen"] - at[first]["tokens_seen"]) / (at[last]["time"] - at[first]["time"])


def run_unbroken(cfg: Config, manifest: DatasetManifest, model: str, warmup: int) -> float:
    import ray

    from ray_jobs.job import build_trainer, worker_config
    from ray_jobs.local import inputs_of
    from ray_jobs.storage import Layout

    ray.init(num_cpus=WORLD, include_dashboard=False, log_to_driver=False)
    try:
        build_trainer(cfg, worker_config(cfg, manifest, inputs_of(cfg, manifest, model))).fit()
    finally:
        ray.shutdown()
    lines = Path(Layout(cfg.storage).metrics(cfg.name)).read_text().splitlines()
    return window_rate([json.loads(x) for x in lines], warmup, cfg.train.max_steps - 1)


def bare_worker(
    rank: int, cfg_json: str, manifest: DatasetManifest, model_path: str, warmup: int, port: int, out
) -> None:
    """A plain DDP loop over the same rows the unbroken rank reads."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ray_jobs.model.loading import load_model
    from ray_jobs.train.model import apply_lora

    cfg = from_json(cfg_json)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(cfg.train.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = load_model(model_path, cfg.data.cache_dir, dtype=torch.float32)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    model = DistributedDataParallel(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    cache = ShardCache(cfg.storage, manifest.dataset_id, cfg.data.cache_dir)
    rows = open_rows(cache, rank_shards(manifest.shards["train"], rank, WORLD), manifest.seq_len)
    sampler, cursor = RankSampler(len(rows), cfg.train.seed, rank), Cursor()
    pad = manifest.tokenizer.pad_token_id
    tokens, started = 0, None
    for step in range(1, cfg.train.max_steps):  # the unbroken window ends at max_steps - 1
        idx, cursor = sampler.take(cursor, cfg.train.micro_batch_size)
        names = ("input_ids", "labels", "position_ids")
        batch = {k: torch.from_numpy(v) for k, v in zip(names, rows.take(idx), strict=True)}
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == warmup:
            dist.barrier()
            started = time.monotonic()
        elif started is not None:
            tokens += int((batch["input_ids"] != pad).sum())
    dist.barrier()
    elapsed = time.monotonic() - started
    total = torch.tensor([tokens], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        out.put(float(total[0]) / elapsed)
    dist.destroy_process_group()


class DistRuntime:
    """The Runtime protocol over a plain torch.distributed gloo group (no Ray): DDP, CPU, reports kept."""

    def __init__(self, rank: int):
        self.rank, self.world_size = rank, WORLD

    def prepare_model(self, model):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)

    def shard_model(self, model):
        raise NotImplementedError("the benchmark runs DDP")

    def device(self):
        import torch

        return torch.device("cpu")

    def report(self, metrics, checkpoint_url) -> None:
        pass

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_object(self, obj):
        import torch.distributed as dist

        out = [None] * WORLD
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def loop_worker(
    rank: int, cfg_json: str, manifest: DatasetManifest, model_path: str, warmup: int, port: int, out
) -> None:
    """unbroken's Trainer on a plain process group: the loop's own cost, without Ray."""
    import torch.distributed as dist

    from ray_jobs.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cfg = from_json(cfg_json)
    trainer = Trainer(cfg, manifest, model_path, DistRuntime(rank))
    trainer.resume_or_start()
    trainer.fit()
    if rank == 0:
        out.put(window_rate(trainer.metrics.rows, warmup, cfg.train.max_steps - 1))
    dist.destroy_process_group()


def run_processes(target, cfg: Config, manifest: DatasetManifest, model: str, warmup: int) -> float:
    """Run ``target`` on WORLD spawned processes; rank 0 puts the tokens/s of the window."""
    import torch.multiprocessing as mp

    from tests.procs import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (cfg.model_dump_json(), manifest, model, warmup, free_port(), out)
    procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    rate = out.get(timeout=3600)
    for p in procs:
        p.join()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs of each leg, interleaved; means are reported")
    p.add_argument("--full", action="store_true", help="full fine-tune instead of the recipe's LoRA")
    args = p.parse_args()
    from tests.models import smollm2

    model = str(smollm2())
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-p1-") as d:
        cfg = bench_config(args, Path(d) / "storage", Path(model))
        manifest = stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest
        rates = {"bare": [], "loop": [], "unbroken": []}
        for k in range(args.repeats):  # legs interleaved, so drift on the machine hits every leg alike
            named = cfg.model_copy(update={"name": f"bench-p1-{k}"})
            rates["bare"].append(run_processes(bare_worker, named, manifest, model, args.warmup))
            rates["loop"].append(run_processes(loop_worker, named, manifest, model, args.warmup))
            named = cfg.model_copy(update={"name": f"bench-p1-ray-{k}"})
            rates["unbroken"].append(run_unbroken(named, manifest, model, args.warmup))
    bare, loop, ours = (statistics.mean(rates[k]) for k in ("bare", "loop", "unbroken"))
    method = "full" if args.full else "LoRA"
    print(json.dumps({"method": method, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                      "window_steps": f"{args.warmup + 1}..{args.steps - 1}", "repeats": args.repeats,
                      "tokens_per_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
                      "ratio": round(ours / bare, 3), "loop_ratio": round(loop / bare, 3)}))  # fmt: skip
    print(f"P1 ({method}, SmolLM2-135M, 2 gloo ranks, mean of {args.repeats}): bare DDP {bare:.1f} tok/s, unbroken "
          f"job on Ray {ours:.1f} tok/s -> ratio {ours / bare:.3f} (target >= 0.97); unbroken's loop without Ray "
          f"{loop:.1f} tok/s -> {loop / bare:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
