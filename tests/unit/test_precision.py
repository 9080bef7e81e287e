"""Full fine-tuning of a real model saved in bf16 (SmolLM2-135M, tied embeddings): fp32 master weights and optimizer
moments whatever the checkpoint's dtype, the tied embedding stored once and still tied after a resume, a stopped
and resumed run bit-identical to a straight one, and an export in the base model's own dtype that loads tied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_jobs.checkpoint import unwrap
from tests.models import smollm2
from tests.unit.smollm2_runs import export_tensors, load_and_generate, newest_checkpoint, real_config, staged, tied
from tests.unit.test_trainer import named, train, weights_hash

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight 3-step run and one stopped after step 2 (its checkpoint) then resumed to 3, on the bf16 copy."""
    model = str(smollm2("bfloat16"))
    cfg = real_config(tmp_path_factory.mktemp("precision") / "storage", model)
    manifest = staged(cfg, model)
    straight = train(named(cfg, "straight", checkpoint__every_steps=0), manifest, model)
    cut = named(cfg, "cut")
    train(cut, manifest, model, stop_at=2)
    resumed = train(cut, manifest, model)
    return cut, straight, resumed


@pytest.mark.full(shard=2)  # a real-model run
def test_a_bf16_checkpoint_trains_fp32_master_weights(runs) -> None:
    _, straight, resumed = runs
    for t in (straight, resumed):
        assert {p.dtype for p in t.model.parameters() if p.requires_grad} == {torch.float32}
        moments = [s for s in t.optimizer.state.values()]
        assert moments and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in moments)


def test_the_checkpoint_on_storage_holds_fp32_weights_and_moments_and_the_tied_embedding_once(runs) -> None:
    cut, _, resumed = runs
    model_sd, optim_sd = newest_checkpoint(cut)
    assert {v.dtype for v in model_sd.values()} == {torch.float32}
    assert EMBED in model_sd and HEAD not in model_sd, "the tied head is the embedding: stored once"
    n_params = len(list(unwrap(resumed.model).parameters()))  # parameters() counts a tied tensor once
    assert len(model_sd) == n_params and len(optim_sd["state"]) == n_params
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in optim_sd["state"].values())


def test_stopped_and_resumed_real_model_is_bit_identical_and_stays_tied(runs) -> None:
    _, straight, resumed = runs
    assert resumed.resumed_from.endswith("checkpoint-step-00000002") and resumed.loop.step == 3
    assert weights_hash(resumed) == weights_hash(straight)
    assert tied(unwrap(resumed.model)) and tied(unwrap(straight.model))


def test_export_auto_is_the_base_dtype_tied_and_generates(runs) -> None:
    _, _, resumed = runs
    final = Path(resumed.export_final())
    config = json.loads((final / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    tensors = export_tensors(final)
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert HEAD not in tensors, "save_pretrained stores a tied head once"
    lm, text = load_and_generate(final)
    assert tied(lm) and lm.lm_head.weight.dtype == torch.bfloat16
    trained = unwrap(resumed.model).model.embed_tokens.weight.detach().to(torch.bfloat16)
    assert torch.equal(lm.model.embed_tokens.weight, trained) and torch.equal(lm.lm_head.weight, trained)
    assert text.startswith("12+3=") and len(text) > len("12+3=")


def test_export_dtype_float32_overrides_the_base_dtype(runs) -> None:
    cut, _, resumed = runs
    resumed.cfg = named(cut, "export-fp32", train__export_dtype="float32")
    final = Path(resumed.export_final())
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    assert {v.dtype for v in export_tensors(final).values()} == {torch.float32}
