"""What does the ``hf`` engine cost against the native loop? Tokens/s of the same run with ``train.engine: native``
and ``train.engine: hf``, side by side in one invocation.

    .venv/bin/python bench/engine_throughput.py [--steps 300 --repeats 3] [--real]

Both engines train in one process (unbroken's Trainer on a LocalRuntime: no Ray, so only the engine differs) on the
same staged rows, the same steps, seed, optimizer and deterministic kernels: the demo config (built-in tiny model,
its addition rows) or, with ``--real``, the SmolLM2-135M chat recipe with LoRA (``make smollm2``; 128-token rows).
Periodic evals and checkpoints are off. Tokens/s is unbroken's own count over its own per-step clock (``elapsed_s``:
from a step's start to its end, both engines; the data fetch is inside it). Runs alternate native / hf; reported
are the medians and their ratio (hf / native).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import record  # noqa: E402
from ray_jobs.config import Config, load_config  # noqa: E402
from ray_jobs.contracts.dataset import DatasetManifest  # noqa: E402


def bench_config(root: Path, engine: str, steps: int, real: bool, name: str) -> Config:
    sets = {
        "name": name, "storage": root / "storage", "data.cache_dir": root / "cache", "train.engine": engine,
        "train.max_steps": steps, "train.eval_every_steps": steps + 1, "train.eval_max_batches": 1,
        "train.log_every_steps": steps, "checkpoint.every_steps": 0, "cluster.num_workers": 1,
    }  # fmt: skip
    if real:
        from configs.models.smollm2 import DEFAULT_OUT

        sets |= {"model.name_or_path": DEFAULT_OUT, "data.seq_len": 128, "train.micro_batch_size": 2}
    recipe = ROOT / "configs" / ("smollm2-chat-lora.yaml" if real else "demo.yaml")
    return load_config(recipe, [f"{k}={v}" for k, v in sets.items()])


def one_run(cfg: Config, manifest: DatasetManifest, model: str) -> float:
    from ray_jobs.job import worker_config
    from ray_jobs.local import inputs_of
    from ray_jobs.train.runtime import LocalRuntime
    from ray_jobs.train.worker import make_trainer

    t = make_trainer(cfg, worker_config(cfg, manifest, inputs_of(cfg, manifest, model)), LocalRuntime(), None)
    t.resume_or_start()
    t.fit()
    return t.loop.tokens_seen / t.loop.elapsed_s


def prepare(root: Path, cfg: Config) -> tuple[DatasetManifest, str]:
    from ray_jobs.data.staging import stage
    from ray_jobs.model.builtin import build_builtin, is_builtin
    from ray_jobs.model.loading import load_tokenizer

    model = cfg.model.name_or_path
    if is_builtin(cfg.model):
        model = str(root / "base")
        build_builtin(cfg.model, cfg.train.seed, model)
    return stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--real", action="store_true", help="SmolLM2-135M, LoRA (make smollm2)")
    args = p.parse_args()
    rates: dict[str, list[float]] = {"native": [], "hf": []}
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        root = Path(tmp)
        manifest, model = prepare(root, bench_config(root, "native", args.steps, args.real, "prep"))
        for i in range(args.repeats):
            for engine in rates:
                cfg = bench_config(root, engine, args.steps, args.real, f"{engine}-{i}")
                rates[engine].append(one_run(cfg, manifest, model))
                print(f"{engine:6s} run {i}: {rates[engine][-1]:10.1f} tokens/s", flush=True)
    native, hf = (statistics.median(rates[e]) for e in ("native", "hf"))
    print(f"\nmedian tokens/s: native {native:.1f}, hf {hf:.1f} -> hf / native {hf / native:.3f}")
    record("engine_throughput" + ("_real" if args.real else ""), {
        "steps": args.steps, "repeats": args.repeats, "native_tokens_per_s": round(native, 1),
        "hf_tokens_per_s": round(hf, 1), "hf_vs_native": round(hf / native, 2)})  # fmt: skip


if __name__ == "__main__":
    main()
