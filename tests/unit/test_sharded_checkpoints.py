"""Sharded checkpoints on two ranks (gloo): each rank writes and reads its own part, the manifest comes last, resume
is bit-identical under DDP and FSDP, a bad part anywhere sends every rank back to the previous checkpoint, and
choosing a checkpoint reads no tensor bytes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, load_config
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.storage import Layout
from tests.conftest import ROOT, tiny_overrides
from tests.unit.dist_runs import run_world, train_and_export_rank, train_rank

WORLD = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("sharded") / "storage"
    overrides = {"train.lr": 0.01, "train.warmup_steps": 3, "cluster.num_workers": WORLD, "cluster.cpus_per_worker": 1,
                 "train.max_steps": 30, "checkpoint.every_steps": 10, "model.tiny.num_layers": 2}  # fmt: skip
    cfg = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(storage, **overrides))
    model = str(storage.parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    return cfg, stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


def named(cfg: Config, name: str, parallelism: str) -> Config:
    c = cfg.model_copy(deep=True)
    c.name, c.train.parallelism = name, parallelism
    return c


def run(cfg: Config, manifest: dict, model: str, stop_at: int | None = None) -> list[dict]:
    return run_world(train_rank, WORLD, cfg, manifest, model, stop_at)


def newest(cfg: Config) -> Path:
    return Path(ckpt.list_checkpoints(Layout(cfg.storage).checkpoints_dir(cfg.name))[0][1])


@pytest.fixture(scope="module")
def straight(setup) -> dict[str, str]:
    """The uninterrupted runs' final weights, per parallelism (the FSDP one also exported, in small files)."""
    cfg, manifest, model = setup
    fsdp = named(cfg, "straight-fsdp", "fsdp")
    fsdp.train.export_shard_mb, fsdp.train.export_dtype = 0.02, "float32"  # a small model: several files + index
    exported = run_world(train_and_export_rank, WORLD, fsdp, manifest, model)
    ddp = run(named(cfg, "straight-ddp", "ddp"), manifest, model)[0]["weights"]
    return {"ddp": ddp, "fsdp": exported[0]["weights"], "export": exported}


@pytest.fixture(scope="module")
def cut(setup) -> dict[str, Config]:
    """A run of each parallelism stopped at step 25 (checkpoints at 10 and 20), once for the module."""
    cfg, manifest, model = setup
    out = {}
    for p in ("ddp", "fsdp"):
        out[p] = named(cfg, f"cut-{p}", p)
        run(out[p], manifest, model, stop_at=25)  # checkpoints at 10 and 20, then "dies" at 25
    return out


def copy_run(src: Config, name: str) -> Config:
    """Another run holding copies of ``src``'s checkpoints."""
    c = src.model_copy(deep=True)
    c.name = name
    shutil.copytree(Layout(src.storage).checkpoints_dir(src.name), Layout(c.storage).checkpoints_dir(name))
    return c


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_each_rank_writes_its_part_and_resume_is_bit_identical(setup, straight, cut, parallelism: str) -> None:
    cfg, manifest, model = setup
    c = copy_run(cut[parallelism], f"resume-{parallelism}")
    folder = newest(c)
    files = json.loads((folder / "manifest.json").read_text())["files"]
    if parallelism == "fsdp":  # each rank's own shards; nothing gathered into one file
        assert {"model-rank-00000.safetensors", "model-rank-00001.safetensors", "optim-rank-00001.pt"} <= set(files)
        assert "optim.pt" not in files
    else:  # the replicated state once, each rank's cursor and RNG of its own
        assert {"model.safetensors", "optim.pt", "rank-00000.json", "rank-00001.json"} <= set(files)
    resumed = run(c, manifest, model)
    assert [r["step"] for r in resumed] == [30, 30]
    assert all(r["resumed_from"].endswith(ckpt.checkpoint_name(20)) for r in resumed)
    assert resumed[0]["weights"] == resumed[1]["weights"] == straight[parallelism]
    if parallelism == "fsdp":
        shared = sum(m["bytes"] for n, m in files.items() if ckpt.owner(n) is None)
        total = sum(m["bytes"] for m in files.values())
        for r in resumed:  # a rank reads the shared files and its own part: about 1/world of the rest
            assert r["bytes_resumed"] <= shared + (total - shared) / WORLD * 1.05, (r["bytes_resumed"], total)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "is 100 bytes"),  # caught from the listing, before reading
        (lambda f: f.write_bytes(bytes(len(f.read_bytes()))), "sha256"),  # only rank 1 can tell: all fall back
    ],
    ids=["truncated", "same-size-corrupt"],
)
def test_one_ranks_bad_part_sends_every_rank_back_to_the_previous_checkpoint(setup, straight, cut, damage, why) -> None:
    cfg, manifest, model = setup
    c = copy_run(cut["fsdp"], f"bad-part-{why.split()[0]}")
    damage(newest(c) / "model-rank-00001.safetensors")
    resumed = run(c, manifest, model)
    assert all(r["resumed_from"].endswith(ckpt.checkpoint_name(10)) for r in resumed)
    assert resumed[0]["weights"] == straight["fsdp"], "resumed from step 10 and still ends where the straight run did"


def test_choosing_a_checkpoint_reads_no_tensor_bytes(cut, monkeypatch, caplog) -> None:
    c = copy_run(cut["fsdp"], "choose")
    damage = newest(c) / "optim-rank-00000.pt"
    damage.write_bytes(damage.read_bytes()[:-1])
    import ray_jobs.checkpoint.format as fmt

    reads: list[str] = []
    real = fmt.read_bytes
    monkeypatch.setattr(fmt, "read_bytes", lambda url: reads.append(url) or real(url))
    with caplog.at_level(logging.WARNING):
        url, manifest_read = ckpt.find_latest_valid(Layout(c.storage).checkpoints_dir(c.name))
    assert url.endswith(ckpt.checkpoint_name(10)) and manifest_read.step == 10
    assert reads and all(r.endswith("manifest.json") for r in reads), reads
    assert any("optim-rank-00000.pt" in r.message for r in caplog.records), "the skipped one is named, and why"


def test_an_fsdp_export_is_gathered_a_tensor_at_a_time_into_sharded_safetensors_hf_loads(straight) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ranks = straight["export"]
    final = Path(ranks[0]["final"])
    assert ranks[1]["final"] is None, "rank 0 writes the export"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    import hashlib

    sd = loaded.state_dict()
    digest = hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest()
    assert digest == straight["fsdp"], "the export holds exactly the trained weights"
