"""A reward model (``train.method: reward``, TRL's RewardTrainer on the hf engine) on preference pairs: what it cannot
take is refused by name when the config loads; the base model gets a new scalar head drawn from ``train.seed``
alone; fed one micro-batch of staged pairs at a time, it learns to score the chosen answer over the rejected on
held-out pairs; a run killed after a checkpoint (which holds the head) resumes bit-identical, each step logged once;
its export loads as a sequence classifier scoring as trained, and no samples are generated from it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ray_jobs.config import ConfigError, load_config
from ray_jobs.data.preference import reward_batch
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_model_fp32, load_reward_model_fp32, load_tokenizer
from ray_jobs.storage import Layout
from tests.conftest import ROOT, tiny_overrides
from tests.unit.test_preference import train
from tests.unit.test_trainer import weights_hash

REWARD = ROOT / "configs" / "demo-reward.yaml"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["data.format=unpaired_preference"], "train.method: reward trains on preference pairs (data.format: "
                                              "preference); data.format=unpaired_preference are labelled completions"),
        (["data.format=prompt_completion"], "train.method: reward trains on preference pairs"),
        (["model.lora={r: 8}"], "model.lora: train.method=reward trains a new scalar head: not with LoRA adapters"),
        (["train.engine=native"], "train.method: reward is computed by trl:RewardTrainer and needs train.engine=hf"),
        (["train.hf_args={center_rewards: 0.1}"], "train.hf_args.center_rewards: not a field of trl.RewardConfig "
                                                  "(did you mean 'center_rewards_coefficient'?)"),
    ],
    ids=["unpaired-records", "prompt-completion-records", "lora", "native-engine", "typo"],
)  # fmt: skip
def test_what_a_reward_model_cannot_take_is_refused_by_name_when_the_config_loads(overrides, says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(REWARD, overrides)
    assert says in str(e.value)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    storage = tmp_path_factory.mktemp("reward") / "storage"
    overrides = {"train.max_steps": 30, "train.eval_every_steps": 10, "train.log_every_steps": 5,
                 "checkpoint.every_steps": 10, "train.sample_generations": 4}  # fmt: skip
    cfg = load_config(REWARD, tiny_overrides(storage, **overrides))
    model = str(storage.parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    return cfg, stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


def test_the_new_head_is_drawn_from_the_seed_alone_on_the_base_weights(setup) -> None:
    _, _, model = setup
    torch.manual_seed(1)
    first = load_reward_model_fp32(model, seed=0)
    torch.manual_seed(2)  # whatever the global RNG drew before
    again, other = load_reward_model_fp32(model, seed=0), load_reward_model_fp32(model, seed=1)
    assert torch.equal(first.score.weight, again.score.weight)
    assert not torch.equal(first.score.weight, other.score.weight), "another seed, another head"
    base = load_model_fp32(model).state_dict()
    assert all(torch.equal(t, base[n]) for n, t in first.state_dict().items() if n != "score.weight"), "the base's"
    assert first.config.architectures == ["LlamaForSequenceClassification"] and first.config.num_labels == 1


@pytest.fixture(scope="module")
def whole(setup):
    cfg, manifest, model = setup
    return train(cfg, manifest, model, "reward")


def test_a_reward_model_learns_the_preference_and_a_killed_run_resumes_bit_identical(setup, whole) -> None:
    cfg, manifest, model = setup
    train(cfg, manifest, model, "reward-cut", stop_at=15)  # checkpoint at 10, "dies" at 15
    resumed = train(cfg, manifest, model, "reward-cut")

    assert resumed.resumed_from.endswith("checkpoint-step-00000010")
    assert weights_hash(resumed) == weights_hash(whole), "the head trained on from its checkpoint, not drawn anew"
    assert resumed.loop.tokens_seen == whole.loop.tokens_seen
    from safetensors import safe_open

    with safe_open(f"{resumed.resumed_from}/model.safetensors", "pt") as f:
        assert set(f.keys()) == {n for n, _ in resumed.model.named_parameters()}, "every weight, the head's too"
    rows = [json.loads(x) for x in Path(Layout(cfg.storage).metrics("reward-cut")).read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"], r["eval_reward_accuracy"]) for r in rows if "eval_loss" in r]
    assert [step for step, _, _ in evals] == [0, 10, 20, 30]
    assert evals[0][1] == pytest.approx(0.693, abs=0.01), "a new head scores both answers alike: a loss of ln 2"
    # measured: held-out loss 0.694 -> 0.449, accuracy 0.52 -> 0.95
    assert evals[-1][1] < evals[0][1] - 0.1 and evals[-1][2] > 0.8, f"the chosen answers scored higher: {evals}"
    assert [r["step"] for r in rows if "reward_accuracy" in r] == list(range(5, 31, 5)), "each logged step once"


def test_the_export_is_a_reward_model_scoring_as_trained_and_no_samples_are_generated(setup, whole) -> None:
    from transformers import AutoModelForSequenceClassification

    cfg, _, _ = setup
    url = whole.export_final(samples=True)  # train.sample_generations: 4, a generating model's would be written
    exported = AutoModelForSequenceClassification.from_pretrained(url).eval()
    batch = reward_batch(*whole.eval_rows.take(np.arange(8)), whole.pad_id)
    whole.model.eval()
    with torch.no_grad():
        assert torch.allclose(exported(**batch).logits, whole.model(**batch).logits, atol=1e-5)
    assert exported.config.pad_token_id == whole.pad_id, "where its score is read: the last token not padding"
    samples = json.loads(Path(Layout(cfg.storage).samples("reward")).read_text())
    assert samples["samples"] == [], "a reward model scores; it does not generate"
