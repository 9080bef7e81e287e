"""A checkpoint write torn for real, on every engine: a run's process is killed (SIGKILL) while its checkpoint's
files are half on storage and its manifest is not; the next run resumes from the checkpoint before, and ends
bit-identical to a run never killed, each step's metrics row logged once.

The kill lands mid-write by design, not by luck: the killed run sleeps after each file of a checkpoint lands
(``checkpoint_file``, ``ray_jobs/faults.py``), and it is the run resumed from the first checkpoint (written in full,
without the delay), so the first write it makes is the one torn. The ``hf`` and DPO resume proofs elsewhere stop
gracefully (``fit(stop_at=...)`` completes the write in flight); this is their kill -9."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ray_jobs.checkpoint import format as ckpt
from ray_jobs.config import Config, load_config
from ray_jobs.faults import ENV
from ray_jobs.storage import Layout
from tests.conftest import ROOT, tiny_overrides
from tests.procs import wait_for
from tests.unit.dist_runs import start_alone, train_alone
from tests.unit.test_hf_engine import train
from tests.unit.test_trainer import staged_builtin, weights_hash

CONFIGS = {"native": (ROOT / "configs" / "demo.yaml", []), "hf": (ROOT / "configs" / "demo.yaml", ["train.engine=hf"]),
           "dpo": (ROOT / "configs" / "demo-dpo.yaml", [])}  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request, tmp_path_factory) -> tuple[Config, dict, str]:
    path, extra = CONFIGS[request.param]
    cfg = load_config(path, [*tiny_overrides(tmp_path_factory.mktemp(request.param) / "storage"), *extra])
    return cfg, *staged_builtin(cfg)


def named(cfg: Config, name: str) -> Config:
    c = cfg.model_copy(deep=True)
    c.name = name
    return c


def torn_write(cfg: Config, step: int) -> Path | None:
    """The checkpoint at ``step`` while some of its files are on storage and its manifest is not."""
    folder = Path(Layout(cfg.storage).checkpoints_dir(cfg.name)) / ckpt.checkpoint_name(step)
    landed = [p for p in folder.glob("*") if ".tmp" not in p.name] if folder.is_dir() else []
    return folder if landed and not (folder / ckpt.MANIFEST_FILE).exists() else None


def test_a_run_killed_mid_checkpoint_write_resumes_from_the_one_before_bit_identical(setup) -> None:
    cfg, manifest, model = setup
    whole = train(named(cfg, "whole"), manifest, model)
    cut = named(cfg, "cut")
    train(cut, manifest, model, stop_at=15)  # the checkpoint at 10 written whole

    killed = start_alone(train_alone, cut, manifest, model, env={ENV: "checkpoint_file:600"})
    try:
        folder = wait_for("the checkpoint at 20 half written", lambda: torn_write(cut, 20), timeout_s=300)
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(timeout=60)
    finally:
        killed.kill()
    assert killed.exitcode == -signal.SIGKILL
    assert torn_write(cut, 20) == folder, "killed with the write torn: files on storage, no manifest"

    resumed = train(cut, manifest, model)
    assert resumed.resumed_from.endswith(ckpt.checkpoint_name(10)), "the torn checkpoint was never loaded"
    assert weights_hash(resumed) == weights_hash(whole), "bit-identical to the run never killed"
    rows = [json.loads(ln) for ln in Path(Layout(cfg.storage).metrics(cut.name)).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(5, 31, 5)), "each logged step once"
    assert (folder / ckpt.MANIFEST_FILE).exists(), "the step-20 checkpoint written again whole"
