"""The ``hf`` engine (``train.engine: hf``): Hugging Face's ``Trainer`` computes every step, unbroken feeds its rows
from the cursor and keeps the optimizer, checkpoints, metrics and resume -- so a killed ``hf`` run resumes
bit-identical, on one worker and on two, and trains the rows the native loop trains. ``train.hf_args`` are checked
against the installed ``TrainingArguments`` when the config loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_jobs.config import Config, ConfigError, load_config
from ray_jobs.config.engines import engine_of
from ray_jobs.storage import Layout
from ray_jobs.train.hf import HfTrainer
from ray_jobs.train.rowtrace import ENV, trained_rows
from ray_jobs.train.runtime import LocalRuntime
from ray_jobs.train.trainer import Trainer
from tests.conftest import ROOT, tiny_overrides
from tests.unit.dist_runs import run_world, train_rank
from tests.unit.test_trainer import staged_builtin, weights_hash

DEMO = ROOT / "configs" / "demo.yaml"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["train.hf_args={learning_rate: 0.1}"],
            "train.hf_args.learning_rate: unbroken sets this from its own config; set train.lr instead",
        ),  # fmt: skip
        (
            ["train.hf_args={label_smoothing: 0.1}"],
            "train.hf_args.label_smoothing: not a field of "
            "transformers.TrainingArguments (did you mean "
            "'label_smoothing_factor'?)",
        ),  # fmt: skip
        (
            ["train.hf_args={neftune_noise_alpha: loud}"],
            "train.hf_args.neftune_noise_alpha: Input should be a valid number",
        ),  # fmt: skip
        (
            ["fault_tolerance.live_recovery=true", "cluster.num_workers=2"],
            "train.engine: hf cannot run fault_tolerance.live_recovery",
        ),  # fmt: skip
        (
            ["train.hf_args={use_liger_kernel: true}"],
            "train.hf_args.use_liger_kernel: Liger's kernels are Triton kernels and need a CUDA device; "
            "set cluster.use_gpu=true",
        ),  # fmt: skip
        (
            ["train.hf_args={use_liger_kernel: true}", "cluster.use_gpu=true"],
            "train.hf_args.use_liger_kernel: needs the liger-kernel package: pip install 'unbroken[gpu]'",
        ),  # fmt: skip (liger-kernel is not installed here: it needs Triton, for CUDA)
        (["train.export=adapter"], "train.export: adapter exports LoRA adapters; set model.lora"),
        (["train.hf_args={deepspeed: ds.json}"], "train.hf_args.deepspeed: not passed to HF (not yet: DeepSpeed owns"),
        (["train.hf_args={adam_beta1: 0.8}"], "train.hf_args.adam_beta1: not passed to HF (unbroken's AdamW)"),
    ],
)
def test_what_the_hf_engine_cannot_take_is_refused_by_name_when_the_config_loads(overrides, says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["train.engine=hf", *overrides])
    assert says in str(e.value)


def test_the_hf_engine_takes_fsdp() -> None:  # trained and resumed in tests/unit/test_hf_fsdp.py
    cfg = load_config(DEMO, ["train.engine=hf", "train.parallelism=fsdp"])
    assert engine_of(cfg).fsdp and cfg.train.parallelism == "fsdp"


def test_hf_args_without_the_hf_engine_are_refused_and_valid_ones_pass() -> None:
    with pytest.raises(ConfigError, match="train.hf_args: only read with train.engine=hf"):
        load_config(DEMO, ["train.hf_args={label_smoothing_factor: 0.1}"])
    cfg = load_config(DEMO, ["train.engine=hf", "train.hf_args={label_smoothing_factor: 0.1}"])
    assert cfg.train.hf_args == {"label_smoothing_factor": 0.1}
    # Liger on a remote cluster's GPUs: whether its workers have liger-kernel is theirs to say, not this machine's
    remote = ["cluster.use_gpu=true", "cluster.address=http://10.0.0.7:8265", "train.hf_args={use_liger_kernel: true}"]
    assert load_config(DEMO, ["train.engine=hf", *remote]).train.hf_args == {"use_liger_kernel": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("hf") / "storage"
    overrides = {"train.lr": 0.01, "train.warmup_steps": 3, "train.engine": "hf", "train.log_every_steps": 1,
                 "cluster.num_workers": 2, "cluster.cpus_per_worker": 1}  # fmt: skip
    cfg = load_config(DEMO, tiny_overrides(storage, **overrides))
    return cfg, *staged_builtin(cfg)


def named(cfg: Config, name: str, engine: str = "hf") -> Config:
    c = cfg.model_copy(deep=True)
    c.name, c.train.engine = name, engine
    return c


def train(cfg: Config, manifest: dict, model: str, stop_at: int | None = None) -> Trainer:
    """A run in this process by the config's engine (HfTrainer for ``hf``), stopped after ``stop_at`` if given."""
    t = (HfTrainer if cfg.train.engine == "hf" else Trainer)(cfg, manifest, model, LocalRuntime())
    t.resume_or_start()
    t.fit(stop_at=stop_at)
    return t


def test_an_hf_run_killed_after_a_checkpoint_resumes_bit_identical_logging_each_step_once(setup) -> None:
    cfg, manifest, model = setup
    whole = train(named(cfg, "hf-whole"), manifest, model)
    cut = named(cfg, "hf-cut")
    train(cut, manifest, model, stop_at=15)  # checkpoint at 10, "dies" at 15
    resumed = train(cut, manifest, model)

    assert resumed.resumed_from.endswith("checkpoint-step-00000010")
    assert weights_hash(resumed) == weights_hash(whole), (
        "HF computed the steps; unbroken's cursor and checkpoint resumed them"
    )
    assert resumed.last_eval == whole.last_eval
    rows = [json.loads(ln) for ln in Path(Layout(cfg.storage).metrics(cut.name)).read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, 31)), "each step's row once: the rows after the checkpoint were not kept twice"
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0], "it learns"
    sealed = Path(resumed.checkpointer.url(30)) / "manifest.json"
    assert json.loads(sealed.read_text())["step"] == 30, "the last step's checkpoint sealed by its manifest"


def test_two_hf_workers_train_the_native_rows_and_resume_bit_identical(setup, tmp_path, monkeypatch) -> None:
    cfg, manifest, model = setup
    monkeypatch.setenv(ENV, str(tmp_path / "native"))  # (one in-process worker: the same rows per step at any size)
    Trainer(named(cfg, "n1", "native"), manifest, model, LocalRuntime()).fit()
    monkeypatch.setenv(ENV, str(tmp_path / "hf"))
    whole = run_world(train_rank, 2, named(cfg, "hf2"), manifest, model, None)
    monkeypatch.setenv(ENV, str(tmp_path / "hf-cut"))
    cut = named(cfg, "hf2-cut")
    run_world(train_rank, 2, cut, manifest, model, 15)
    resumed = run_world(train_rank, 2, cut, manifest, model, None)

    assert trained_rows(tmp_path / "hf")[0] == trained_rows(tmp_path / "native")[0], "the native loop's rows"
    assert trained_rows(tmp_path / "hf-cut")[0] == trained_rows(tmp_path / "hf")[0], "none lost, none twice"
    assert resumed[0]["resumed_from"].endswith("checkpoint-step-00000010")
    assert resumed[0]["weights"] == resumed[1]["weights"] == whole[0]["weights"], "bit-identical at two workers"
