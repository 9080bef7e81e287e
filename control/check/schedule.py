"""What the scanned data makes of a run's schedule, by the flow's own rules: the manifest staging would write (its
counts and shards; no dataset id, no hashes), ``train.epochs`` made steps or ``train.max_steps`` told in epochs
(``ray_jobs/config/epochs.py``: data rank ``v`` of ``cluster.num_workers`` -- its max when elastic -- owns train shards
``v, v+V, ...``; the one with the most rows sets the steps), a train shard for every data rank (the flow's fit check,
``control/backends/fit.py``), and how long the steps take at the tokens/s the engine benchmark measured for this
model, engine and machine (``bench/results.json``) -- or "unknown" where nothing was measured that applies."""

from __future__ import annotations

import tempfile
from pathlib import Path

from control.check.findings import Finding, ok, problem
from control.check.scan import Scan
from ray_jobs.config import Config
from ray_jobs.contracts.dataset import Counts, DatasetManifest, Shard, StagedSource, TokenizerInfo


def manifest(scan: Scan) -> DatasetManifest:
    """The manifest staging would write for the scanned data, but for what needs the bytes written (the dataset id,
    the sources' and shards' hashes, the shards' sizes)."""
    from ray_jobs.data.pack import shard_bounds
    from ray_jobs.data.staging import STAGING_VERSION, split_shards, staging_config

    data, c, rows = scan.data, scan.counts, {f"{split}_rows": n for split, n in scan.rows.items()}
    shards = {}
    for split, n in scan.rows.items():
        b = shard_bounds(n, split_shards(n, split, data))
        shards[split] = [
            Shard(file=f"{split}-{i:05d}.parquet", rows=b[i + 1] - b[i], bytes=0, sha256="") for i in range(len(b) - 1)
        ]
    tokenizer = scan.tokenizer
    eos = tokenizer.eos_token_id
    return DatasetManifest(
        dataset_id="(not staged)",
        staging_version=STAGING_VERSION,
        seq_len=data.seq_len,
        sources={s: [StagedSource(url=f.url, bytes=f.size, sha256="") for f in scan.files(s)] for s in scan.rows},
        tokenizer=TokenizerInfo(
            name_or_path=scan.tokenizer_name,
            fingerprint="",
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0),
            eos_token_id=eos,
        ),
        staging_config=staging_config(data),
        counts=Counts(**{**{k: c[k] for k in Counts.model_fields if k in c}, **rows}),
        shards=shards,
    )


def findings(cfg: Config, m: DatasetManifest) -> tuple[list[Finding], Config]:
    """The schedule's lines, and ``cfg`` with what it says in epochs made steps (what the flow will run)."""
    from control.backends.fit import data_problems
    from ray_jobs.config.epochs import resolve_epochs

    run = resolve_epochs(cfg, m)
    found = [ok("plan", epochs_line(run, m)), time_line(run, m)]
    return found + [problem("plan", p) for p in data_problems(cfg, m)], run


def epochs_line(run: Config, m: DatasetManifest) -> str:
    """Steps <-> epochs, over the rows of the data rank with the most (``run``: epochs resolved to steps)."""
    from ray_jobs.config.epochs import data_rank_rows

    t, ranks, shards = run.train, run.cluster.max_workers, m.shards["train"]
    per_step, most = t.micro_batch_size * t.grad_accum_steps, max(data_rank_rows(shards, ranks))
    layout = f"({ranks} data ranks over {len(shards)} train shards, {per_step} rows a step each)"
    if t.epochs is not None:
        return (
            f"train.epochs={t.epochs} is {t.max_steps:,} steps: {t.epochs} passes over the {most:,} rows of the data "
            f"rank with the most {layout}"
        )
    epochs = t.max_steps * per_step / most if most else 0.0
    return (
        f"train.max_steps={t.max_steps:,} is {epochs:,.2f} epochs: {t.max_steps * per_step:,} rows a data rank, of "
        f"the {most:,} the one with the most has {layout}"
    )


def time_line(run: Config, m: DatasetManifest) -> Finding:
    """The training's duration at the engine's measured tokens/s (the tokens a step trains: its rows' tokens, on
    average the train split's), or "unknown"."""
    found = measured(run)
    if found is None:
        return ok(
            "plan",
            f"time: unknown -- no engine measurement in bench/results.json is of this model with train.engine="
            f"{run.train.engine} on a machine like this one",
        )
    rate, where = found
    c, t = m.counts, run.train
    tokens = t.max_steps * t.micro_batch_size * t.grad_accum_steps * run.cluster.max_workers
    tokens *= c.train_tokens / max(1, c.train_rows)
    return ok(
        "plan",
        f"time, estimated: {_duration(tokens / rate)} of training -- {t.max_steps:,} steps, {tokens:,.0f} tokens at "
        f"{rate:,.0f} tokens/s ({where}); starting, evals and checkpoints not counted",
    )


def measured(cfg: Config) -> tuple[float, str] | None:
    """The tokens/s the engine benchmark (bench/engine_throughput.py) recorded for this config's model, engine and
    sequence shape on a machine like this one (its CPU count and architecture), and where it is from; None without
    one -- an installed unbroken has no benchmarks, a GPU's are of the GPU kit's own model."""
    try:
        from bench.engine_throughput import bench_config
        from bench.results import load, machine
    except ImportError:
        return None
    if cfg.cluster.use_gpu:
        return None
    results = load()
    for key, real in (("engine_throughput", False), ("engine_throughput_real", True)):
        r = results.get(key, {})
        rate = r.get(f"{cfg.train.engine}_tokens_per_s")
        if not rate or r.get("machine") != machine():
            continue
        try:
            bench = bench_config(Path(tempfile.gettempdir()), cfg.train.engine, 1, real, "bench")
        except Exception:  # noqa: BLE001 -- a recipe this checkout cannot load (its model not built): not this one
            continue
        if _same_work(cfg, bench):
            return float(rate), f"bench/results.json {key}, {r['measured']}, {r['machine']}, one worker"
    return None


def _same_work(cfg: Config, bench: Config) -> bool:
    """Whether a step of ``cfg`` is the work the benchmark timed: its model, sequence length and step's settings."""
    keys = ("micro_batch_size", "precision", "gradient_checkpointing", "compile", "parallelism", "engine")
    same_train = all(getattr(cfg.train, k) == getattr(bench.train, k) for k in keys)
    return cfg.model == bench.model and cfg.data.seq_len == bench.data.seq_len and same_train


def _duration(s: float) -> str:
    if s < 90:
        return f"about {s:.0f} s"
    return f"about {s / 60:.1f} min" if s < 5400 else f"about {s / 3600:.1f} h"
