"""The training loop in-process (LocalRuntime): it learns, resumes exactly, and exports a loadable HF folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ray_jobs.base_model import build_builtin
from ray_jobs.config import Config, load_config
from ray_jobs.runtime import LocalRuntime
from ray_jobs.staging import stage
from ray_jobs.trainer import Trainer
from tests.conftest import ROOT, tiny_overrides


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("trainer") / "storage"
    cfg = load_config(
        ROOT / "configs" / "demo.yaml", tiny_overrides(storage, **{"train.lr": 0.01, "train.warmup_steps": 3})
    )
    model = str(storage.parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    from ray_jobs.base_model import load_tokenizer

    staged = stage(cfg.data, load_tokenizer(model), model, cfg.storage)
    return cfg, staged.manifest, model


def weights_hash(trainer: Trainer) -> str:
    state = trainer.model.state_dict()
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def train(cfg: Config, manifest: dict, model: str, root: Path, stop_at: int | None = None) -> Trainer:
    t = Trainer(cfg, manifest, model, LocalRuntime(root))
    t.resume_or_start()
    t.fit(stop_at=stop_at)
    return t


def test_eval_loss_falls_and_metrics_are_logged(setup, tmp_path: Path) -> None:
    cfg, manifest, model = setup
    t = train(cfg, manifest, model, tmp_path / "a")
    rows = t.metrics.rows
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 10, 20, 30]
    assert evals[-1] < evals[0] * 0.7
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen"} <= set(rows[-1])


def test_stopped_and_resumed_run_is_bit_identical(setup, tmp_path: Path) -> None:
    cfg, manifest, model = setup
    straight = weights_hash(train(cfg, manifest, model, tmp_path / "straight"))
    interrupted = tmp_path / "interrupted"
    cut = train(cfg, manifest, model, interrupted, stop_at=20)  # checkpoints at 10 and 20, then "dies"
    assert cut.loop.step == 20 and weights_hash(cut) != straight
    resumed = train(cfg, manifest, model, interrupted)
    assert resumed.loop.step == 30
    assert weights_hash(resumed) == straight
    logged = [r["step"] for r in resumed.metrics.rows]
    assert logged == sorted(set(logged)), "metrics.jsonl holds each step once after a resume"


def test_final_export_loads_with_transformers_and_generates(setup, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, manifest, model = setup
    t = train(cfg, manifest, model, tmp_path / "x")
    url = t.export_final()
    final = Path(url)
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in final.iterdir()}
    tok = AutoTokenizer.from_pretrained(final)
    lm = AutoModelForCausalLM.from_pretrained(final)
    out = lm.generate(**tok("<s>12+3=", add_special_tokens=False, return_tensors="pt"), max_new_tokens=3)
    assert out.shape[1] > 0
    card = (final / "README.md").read_text()
    assert manifest["dataset_id"] in card and "eval loss at step 0" in card
    assert json.loads((final / "config.json").read_text())["model_type"] == "llama"
