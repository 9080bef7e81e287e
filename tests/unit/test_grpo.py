"""GRPO (``train.method: grpo``, TRL's GRPOTrainer on the hf engine) with verifiable rewards: the config's checks
name their field; prompts are staged one a row and sampled from as staged; a run killed after a checkpoint resumes
bit-identical (the sampling RNG restored with the rest); rewards and completion lengths are logged once per step; a
reward function that raises, miscounts, returns a non-number or hangs fails the run as a user error naming it, the
step and the example, the checkpoints kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import ConfigError, load_config
from ray_jobs.config.train import RewardFunction
from ray_jobs.data.staging import stage
from ray_jobs.errors import user_error
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.storage import Layout
from ray_jobs.train.grpo import Reward, RewardError, generation_batch
from ray_jobs.train.hf import HfTrainer
from ray_jobs.train.runtime import LocalRuntime
from tests.conftest import ROOT, tiny_overrides
from tests.unit.test_trainer import staged_builtin, weights_hash
from tests.unit.test_trainer import train as native_train

GRPO = ROOT / "configs" / "demo-grpo.yaml"
DEMO = ROOT / "configs" / "demo.yaml"


def grpo_config(storage: Path, *extra: str):
    return load_config(GRPO, tiny_overrides(storage, **{"model.name_or_path": "builtin:tiny-llama"}) + list(extra))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["train.rewards=[]"], "train.rewards: train.method=grpo scores its completions by reward functions"),
        (["train.method=sft"], "train.rewards: only read by train.method=grpo"),
        (["train.engine=native"], "train.method: grpo is computed by trl:GRPOTrainer and needs train.engine=hf"),
        (["data.format=preference"], "train.method: grpo trains on prompts"),
        (["data.format=text"], "data.format=text are documents"),
        (["train.epochs=1"], "train.epochs: not with train.method=grpo yet"),
        (["train.hf_args={num_generation: 4}"], "not a field of trl.GRPOConfig (did you mean 'num_generations'?)"),
        (["train.hf_args={steps_per_generation: 2}"], "set train.grad_accum_steps (completions are sampled once"),
        (["train.rewards=[{function: 'configs.rewards.addition'}]"], "is not module:function"),
    ],
)
def test_a_grpo_config_that_cannot_run_is_refused_naming_the_field(tmp_path, overrides, says) -> None:
    with pytest.raises(ConfigError) as e:
        grpo_config(tmp_path, *overrides)
    assert says in str(e.value)


def test_grpo_stages_one_prompt_a_row_and_hands_trl_the_prompt_its_group_and_answer(tmp_path) -> None:
    cfg = grpo_config(tmp_path / "s")
    assert (cfg.data.packing, cfg.data.train_on) == (False, "last_assistant"), "set for the method"
    manifest, model = staged_builtin(cfg)
    c = manifest.counts
    assert c.train_rows == c.train_examples and c.eval_rows == c.eval_examples, "one record a row"
    tok = load_tokenizer(model)
    records = [json.loads(x) for x in (ROOT / "configs" / "data" / "addition.jsonl").read_text().splitlines()]
    ids = [tok(r["input"] + r["target"])["input_ids"] for r in records[:2]]
    staged = np.full((2, 3, cfg.data.seq_len), 0, dtype=np.int64)
    for i, (r, row) in enumerate(zip(records[:2], ids, strict=True)):
        n, p = len(row), len(tok(r["input"])["input_ids"])
        staged[i, 0, :n], staged[i, 1] = row, -100
        staged[i, 1, p:n] = row[p:]
        staged[i, 2, :n], staged[i, 2, n:] = np.arange(n), np.arange(cfg.data.seq_len - n)
    batch = generation_batch(tuple(staged[:, k] for k in range(3)), tok, generations=3)
    assert [b["prompt"] for b in batch] == [records[0]["input"]] * 3 + [records[1]["input"]] * 3
    assert [b["answer"] for b in batch[::3]] == [r["target"] for r in records[:2]]
    assert batch[0]["prompt_ids"] == tok(records[0]["input"])["input_ids"]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> str:
    """The demo's tiny model after a short SFT on the addition data: right some of the time, so sampled groups
    differ and GRPO has a signal."""
    root = tmp_path_factory.mktemp("grpo-sft")
    overrides = {"name": "sft", "storage": root / "storage", "data.cache_dir": root / "cache", "data.seq_len": 32,
                 "train.max_steps": 150, "train.eval_every_steps": 1000, "checkpoint.every_steps": 1000,
                 "train.sample_generations": 0, "train.warmup_steps": 20}  # fmt: skip
    cfg = load_config(DEMO, [f"{k}={v}" for k, v in overrides.items()])  # the demo's model: it learns in seconds
    manifest, model = staged_builtin(cfg)
    url = native_train(cfg, manifest, model).export_final()
    assert url is not None
    return url


def grpo_run(storage: Path, model: str, name: str, stop_at: int | None = None, **extra) -> HfTrainer:
    overrides = {"name": name, "model.name_or_path": model, "train.max_steps": 12, "checkpoint.every_steps": 4,
                 "train.eval_every_steps": 6, "train.log_every_steps": 1, "train.micro_batch_size": 4, **extra}  # fmt: skip
    cfg = load_config(GRPO, tiny_overrides(storage, **overrides))
    manifest = stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest
    t = HfTrainer(cfg, manifest, model, LocalRuntime())
    t.resume_or_start()
    t.fit(stop_at=stop_at)
    return t


def test_a_grpo_run_killed_after_a_checkpoint_resumes_bit_identical_logging_each_step_once(tmp_path, sft_model):
    whole = grpo_run(tmp_path / "s", sft_model, "grpo-whole")
    grpo_run(tmp_path / "s", sft_model, "grpo-cut", stop_at=6)  # checkpoint at 4, "dies" at 6
    resumed = grpo_run(tmp_path / "s", sft_model, "grpo-cut")

    assert resumed.resumed_from.endswith("checkpoint-step-00000004")
    assert weights_hash(resumed) == weights_hash(whole), "the same completions sampled, the same steps taken"
    log = Layout(str(tmp_path / "s")).metrics
    rows = [json.loads(x) for x in Path(log("grpo-cut")).read_text().splitlines()]
    whole_rows = [json.loads(x) for x in Path(log("grpo-whole")).read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == list(range(1, 13)), "each step once, across the restart"
    for key in ("reward", "reward_correct", "reward_digits_only", "completion_length", "reward_std"):
        assert [r[key] for r in rows if key in r] == [r[key] for r in whole_rows if key in r], key
    assert 0 < np.mean([r["reward_correct"] for r in rows if "reward" in r]) < 1, "groups differ: a signal"


@pytest.mark.parametrize(
    "function, says",
    [
        ("raises", "raised ZeroDivisionError: division by zero at step"),
        ("too_few", "returned 31 values; expected a list of 32 (one per completion)"),
        ("not_numbers", "returned 'yes': a reward is a number (or None)"),
        ("hangs", "did not return within 0.5s"),
    ],
)
def test_a_failing_reward_function_is_named_with_the_step_and_the_example(function, says) -> None:
    prompts, completions = ["1+1="] * 32, ["2"] * 32
    reward = Reward(RewardFunction(function=f"tests.unit.grpo_rewards:{function}"), lambda: 7, timeout_s=0.5)
    with pytest.raises(RewardError) as e:

        class State:
            global_step = 9

        reward(prompts, completions, trainer_state=State())
    assert says in str(e.value) and "at step 7" in str(e.value) and "prompt '1+1=', completion '2'" in str(e.value)
    assert f"train.rewards: tests.unit.grpo_rewards:{function}" in str(e.value)


@pytest.mark.parametrize("function, says", [("missing_one", "has no missing_one"), ("NOT_CALLABLE", "not a function")])
def test_a_reward_that_cannot_be_had_is_named(function, says) -> None:
    with pytest.raises(RewardError, match=says):
        Reward(RewardFunction(function=f"tests.unit.grpo_rewards:{function}"), lambda: 1)
    with pytest.raises(RewardError, match="cannot import no_such_module"):  # (one a worker could not import)
        Reward(RewardFunction.model_construct(function="no_such_module:f", weight=1.0), lambda: 1)


def test_a_run_whose_reward_raises_fails_as_a_user_error_keeping_its_checkpoint(tmp_path, sft_model) -> None:
    rewards = "[{function: 'tests.unit.grpo_rewards:raises'}]"
    with pytest.raises(RewardError) as e:
        grpo_run(tmp_path / "s", sft_model, "grpo-raises", **{"train.rewards": rewards})
    assert user_error(e.value) is e.value, "the CLI and the watchdog read it as the user's"
    assert "tests.unit.grpo_rewards:raises raised ZeroDivisionError: division by zero at step 6" in str(e.value)
    kept = ckpt.find_latest_valid(Layout(str(tmp_path / "s")).checkpoints_dir("grpo-raises"))
    assert kept is not None and kept[0].endswith("checkpoint-step-00000004"), "nothing trained before it lost"


def test_the_rewards_code_is_found_here_or_taken_from_the_last_job_else_said(tmp_path, monkeypatch, caplog) -> None:
    """What a job ships of the user's code: the rewards' package found where unbroken runs; a watchdog elsewhere
    ships what the previous job was shipped; with neither, the job goes without it and that is said. And the
    checks before a run (``run``'s and ``check``'s) name a reward that is nowhere, before any cluster work."""
    from control.check.probes import rewards
    from control.jobcode import user_code

    cfg = grpo_config(tmp_path)
    assert user_code(cfg) == [str(ROOT / "configs")]
    assert [f.text for f in rewards(cfg) if f.problem] == []
    monkeypatch.chdir(tmp_path)  # a watchdog elsewhere: the module is nowhere on its path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    for name in [m for m in sys.modules if m == "configs" or m.startswith("configs.")]:
        monkeypatch.delitem(sys.modules, name)
    assert user_code(cfg, lambda: ["gcs://_ray_pkg_abc.zip"]) == ["gcs://_ray_pkg_abc.zip"]
    assert user_code(cfg, lambda: None) == []
    assert "configs.rewards.addition not found here" in caplog.text
    problems = [f.text for f in rewards(cfg) if f.problem]
    assert [p.split(": cannot import ")[0] for p in problems] == [
        "train.rewards[0].function",
        "train.rewards[1].function",
    ]
    assert all(p.endswith("cannot import configs.rewards.addition: No module named 'configs'") for p in problems), (
        problems
    )
