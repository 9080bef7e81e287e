"""``train.parallelism: fsdp`` under the ``hf`` engine (``ray_jobs/train/hf_fsdp.py``): HF's Trainer computes each step
on unbroken's FSDP2 shards. Two workers (gloo, CPU) train the demo, each rank's checkpoint holds its own shards of the
weights and the optimizer (the native FSDP run's files), and a run stopped after a checkpoint resumes bit-identical;
a step's gradients are reduce-scattered once, on its last micro-batch. DPO too, its frozen reference in shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, load_config
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.storage import Layout
from ray_jobs.train.hf_fsdp import step_sync
from tests.conftest import ROOT, tiny_overrides
from tests.unit.dist_runs import full_weights_hash, run_world, train_rank
from tests.unit.test_trainer import staged_builtin

WORLD = 2
SHARDS = {f"{kind}-rank-{r:05d}.{ext}" for kind, ext in (("model", "safetensors"), ("optim", "pt")) for r in (0, 1)}


def staged(tmp_path_factory, config: str, **overrides: object) -> tuple[Config, DatasetManifest, str]:
    storage = tmp_path_factory.mktemp("hf-fsdp") / "storage"
    overrides = {"train.engine": "hf", "train.parallelism": "fsdp", "cluster.num_workers": WORLD,
                 "cluster.cpus_per_worker": 1, "train.max_steps": 20, "checkpoint.every_steps": 10, **overrides}  # fmt: skip
    cfg = load_config(ROOT / "configs" / config, tiny_overrides(storage, **overrides))
    return cfg, *staged_builtin(cfg)


def named(cfg: Config, name: str) -> Config:
    c = cfg.model_copy(deep=True)
    c.name = name
    return c


def logged(cfg: Config, name: str) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(Layout(cfg.storage).metrics(name)).read_text().splitlines()]


def sealed_files(cfg: Config, name: str) -> dict[str, dict]:
    """The files the newest checkpoint's manifest seals, with their sizes."""
    newest = ckpt.list_checkpoints(Layout(cfg.storage).checkpoints_dir(name))[0][1]
    return json.loads((Path(newest) / "manifest.json").read_text())["files"]


def test_gradients_are_reduce_scattered_on_each_steps_last_micro_batch_only() -> None:
    class Sharded:  # what an FSDP2 module offers the engine: whether the next backward reduce-scatters
        def __init__(self):
            self.syncs: list[bool] = []

        def set_requires_gradient_sync(self, sync: bool) -> None:
            self.syncs.append(sync)

    model, sync = Sharded(), step_sync(True, 3)
    for _ in range(2 * 3):  # two steps of three micro-batches
        with sync(model):
            pass
    assert model.syncs == [False, False, True] * 2
    untouched = Sharded()
    with step_sync(False, 3)(untouched):  # under DDP accelerate's no_sync defers the all-reduce: nothing set here
        pass
    assert untouched.syncs == []


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> tuple[Config, DatasetManifest, str]:
    """The demo at two workers, two micro-batches a step per worker (the reduce-scatter deferred once a step)."""
    return staged(tmp_path_factory, "demo.yaml", **{"train.lr": 0.01, "train.warmup_steps": 3,
                  "train.log_every_steps": 1, "train.grad_accum_steps": 2, "train.micro_batch_size": 8})  # fmt: skip


def test_two_hf_workers_train_on_fsdp_shards_and_a_stopped_run_resumes_bit_identical(sft) -> None:
    cfg, manifest, model = sft
    whole = run_world(train_rank, WORLD, named(cfg, "whole"), manifest, model, None)
    cut = named(cfg, "cut")
    run_world(train_rank, WORLD, cut, manifest, model, 15)  # checkpoint at 10, "dies" at 15
    resumed = run_world(train_rank, WORLD, cut, manifest, model, None)

    assert [r["step"] for r in resumed] == [20, 20]
    assert all(r["resumed_from"].endswith(ckpt.checkpoint_name(10)) for r in resumed)
    assert resumed[0]["weights"] == resumed[1]["weights"] == whole[0]["weights"], "bit-identical on FSDP shards"
    files = sealed_files(cfg, "cut")
    assert set(files) >= SHARDS and not {"model.safetensors", "optim.pt"} & set(files), "each rank its own part"
    base = (Path(model) / "model.safetensors").stat().st_size
    for r in (0, 1):  # a part, not the whole model: sharded before HF saw it, never wrapped in DDP
        assert files[f"model-rank-{r:05d}.safetensors"]["bytes"] < 0.6 * base, (files, base)
    rows = logged(cfg, "cut")
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 21)), "each step's row once"
    assert losses[-1] < 0.6 * losses[0] and evals[-1] < 0.6 * evals[0], f"it learns: {losses}, {evals}"
    assert all(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows if "loss" in r)


def dpo_rank(rank: int, cfg: Config, manifest: DatasetManifest, model: str) -> dict[str, Any]:
    """One rank of a DPO run trained to the end: its weights, and whether TRL's reference is in shards."""
    from torch.distributed.tensor import DTensor

    from ray_jobs.train.hf import HfTrainer
    from ray_jobs.train.runtime import TorchRuntime

    t = HfTrainer(cfg, manifest, model, TorchRuntime())
    t.resume_or_start()
    t.fit()
    reference = t.engine().ref_model
    return {"weights": full_weights_hash(t), "reference_in_shards": all(isinstance(p, DTensor) for p in
            reference.parameters())}  # fmt: skip


@pytest.mark.full(shard=0)
def test_dpo_on_fsdp_shards_its_reference_and_a_stopped_run_resumes_bit_identical(tmp_path_factory) -> None:
    cfg, manifest, model = staged(tmp_path_factory, "demo-dpo.yaml", **{"train.eval_every_steps": 10})
    whole = run_world(dpo_rank, WORLD, named(cfg, "dpo"), manifest, model)
    cut = named(cfg, "dpo-cut")
    run_world(train_rank, WORLD, cut, manifest, model, 15)
    resumed = run_world(train_rank, WORLD, cut, manifest, model, None)

    assert all(r["resumed_from"].endswith(ckpt.checkpoint_name(10)) for r in resumed)
    assert resumed[0]["weights"] == resumed[1]["weights"] == whole[0]["weights"] == whole[1]["weights"]
    assert all(w["reference_in_shards"] for w in whole), "no whole copy of the reference on a rank"
    assert set(sealed_files(cfg, "dpo-cut")) >= SHARDS
    evals = [(r["eval_loss"], r.get("eval_reward_accuracy")) for r in logged(cfg, "dpo-cut") if "eval_loss" in r]
    assert evals[0][0] == pytest.approx(np.log(2)), "at step 0 the policy is the reference: DPO's loss is ln 2"
    assert evals[-1][0] < evals[0][0] and evals[-1][1] > 0.6, f"held-out pairs preferred as the set teaches: {evals}"
