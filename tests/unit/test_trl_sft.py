"""``train.method: trl_sft``: TRL's SFTTrainer computes each step of the hf engine on unbroken's packed rows -- the
same loss as HF's own Trainer (its first step's weights equal), its token accuracy and entropy logged once per step,
and a run killed after a checkpoint resumes bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_jobs.storage import Layout
from tests.unit.test_hf_engine import named, train
from tests.unit.test_hf_engine import setup as hf_setup  # noqa: F401 -- the module's fixture, shared
from tests.unit.test_trainer import weights_hash


@pytest.fixture(scope="module")
def setup(hf_setup):  # noqa: F811 -- one worker
    cfg, manifest, model = hf_setup
    c = cfg.model_copy(deep=True)
    c.cluster.num_workers = 1
    return c, manifest, model


def trl(cfg, name: str):
    c = named(cfg, name)
    c.train.method = "trl_sft"
    return c


def test_trl_sft_takes_hf_trainers_first_step_and_resumes_bit_identical_logging_its_accuracy_once(setup) -> None:
    cfg, manifest, model = setup
    plain, first = (
        train(named(cfg, "plain-1"), manifest, model, stop_at=1),
        train(trl(cfg, "trl-1"), manifest, model, stop_at=1),
    )
    a, b = plain.model.state_dict(), first.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "the same loss: the same first step"
    whole = train(trl(cfg, "trl-whole"), manifest, model)
    train(trl(cfg, "trl-cut"), manifest, model, stop_at=15)  # checkpoint at 10, "dies" at 15
    resumed = train(trl(cfg, "trl-cut"), manifest, model)
    assert resumed.resumed_from.endswith("checkpoint-step-00000010")
    assert weights_hash(resumed) == weights_hash(whole)
    rows = [json.loads(x) for x in Path(Layout(cfg.storage).metrics("trl-cut")).read_text().splitlines()]
    logged = [r for r in rows if "token_accuracy" in r]
    assert [r["step"] for r in logged] == list(range(1, 31)), "each step once, across the restart"
    assert logged[-1]["token_accuracy"] > logged[0]["token_accuracy"] and "entropy" in logged[-1]
