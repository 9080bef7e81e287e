"""Preference records (``data.format: preference``, TRL's prompt/chosen/rejected) and DPO through TRL on the hf
engine: staged one record per row, validated and quarantined by file:line like every shape, detected by ``auto``;
the rows give TRL's DPOTrainer exactly what its own collator builds; DPO raises held-out reward accuracy, and a run
killed after a checkpoint resumes bit-identical -- full and LoRA (the reference stays the base)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ray_jobs.config import ConfigError, DataConfig, load_config
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.preference import pair_batch
from ray_jobs.data.reading import load_rows
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.model.builtin import build_builtin, train_char_tokenizer
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.storage import Layout
from ray_jobs.train.hf import HfTrainer
from tests.conftest import ROOT, tiny_overrides
from tests.unit.test_hf_engine import train as hf_train
from tests.unit.test_trainer import weights_hash

PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
DPO = ROOT / "configs" / "demo-dpo.yaml"


def write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def plain(i: int) -> dict:
    return {"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": f"{2 * i}{i % 10}"}


def conversational(i: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "chosen": [{"role": "assistant", "content": str(2 * i)}],
            "rejected": [{"role": "assistant", "content": f"{2 * i + 1}"}]}  # fmt: skip


@pytest.mark.parametrize("make", [plain, conversational], ids=["plain", "conversational"])
def test_each_record_stages_one_row_that_gives_trl_what_its_collator_builds(tmp_path: Path, make) -> None:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = train_char_tokenizer()
    tok.chat_template = PLAIN_TEMPLATE
    src = write_jsonl(tmp_path / "p.jsonl", [make(i) for i in range(40)])
    staged = stage(DataConfig(train=str(src), format="auto", seq_len=48, min_shards=1, eval_fraction=0.1), tok, "t",
                   str(tmp_path / "s"))  # fmt: skip
    m = staged.manifest
    assert m.format == "preference"
    c = m.counts
    assert c.train_examples + c.eval_examples == 40 == c.train_rows + c.eval_rows, "one row per record"
    ids, labels, coded = load_rows(
        ShardCache(str(tmp_path / "s"), m.dataset_id, str(tmp_path / "c")), m.shards["train"], 48
    )
    pad = m.tokenizer.pad_token_id
    ours = pair_batch(ids, labels, coded, pad)
    examples = []  # what TRL's own tokenization would give: a shared prompt, then each answer
    for chosen_ids, chosen_labels, rejected in zip(ids, labels, coded, strict=True):
        start = int(np.argmax(chosen_labels != -100))
        end = len(chosen_labels) - int(np.argmax(chosen_labels[::-1] != -100))
        rejected = rejected[rejected != -1]
        assert (-rejected[rejected <= -2] - 2 == chosen_ids[:start]).all(), "the prompt both answers follow"
        examples.append({"prompt_ids": chosen_ids[:start].tolist(), "chosen_ids": chosen_ids[start:end].tolist(),
                         "rejected_ids": rejected[rejected >= 0].tolist()})  # fmt: skip
    theirs = DataCollatorForPreference(pad_token_id=pad)(examples)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert ours[key].tolist() == theirs[key].tolist(), key
    keep = np.arange(len(ids)) % 3 != 0  # pairs past train.epochs' last pass: read, attended to, never learned
    past = pair_batch(ids, labels, coded, pad, keep=keep)
    both = np.concatenate([keep, keep])
    assert past["completion_mask"][~both].sum() == 0
    assert past["completion_mask"][both].tolist() == ours["completion_mask"][both].tolist()
    for key in ("input_ids", "attention_mask"):
        assert past[key].tolist() == ours[key].tolist(), key


BAD = [
    ({"prompt": "1+1=", "chosen": "2"}, "missing field 'rejected' (data.format=preference)"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": [{"role": "assistant", "content": "3"}]},
     "fields 'prompt', 'chosen' and 'rejected' must all be strings or all lists of messages, got str, str, list"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "3" * 60}, "prompt + rejected answer is 66 tokens, longer than "
                                                              "data.seq_len (48)"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "reason"), BAD, ids=["missing", "mixed", "too-long"])
def test_a_bad_preference_record_is_quarantined_by_file_and_line(tmp_path: Path, bad: dict, reason: str) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [plain(i) for i in range(20)] + [bad] + [plain(99)])
    data = DataConfig(train=str(src), format="preference", seq_len=48, min_shards=1, eval_fraction=0.3)
    with pytest.raises(StagingError) as err:
        stage(data, train_char_tokenizer(), "t", str(tmp_path / "s"))
    assert f"{src}:21: {reason}" in str(err.value)
    r = stage(data.model_copy(update={"max_reject_fraction": 0.1}), train_char_tokenizer(), "t", str(tmp_path / "s"))
    rejects = [json.loads(x) for x in (tmp_path / "s" / "datasets" / r.dataset_id / "rejects.jsonl").open()]
    assert [(x["line"], x["reason"]) for x in rejects] == [(21, reason)]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["train.engine=native"],
            "data.format: preference records are trained by DPO (TRL's DPOTrainer), which needs train.engine=hf",
        ),  # fmt: skip
        (["data.too_long=truncate"], "data.too_long: truncate cannot cut a preference pair"),
        (["train.hf_args={beta: strong}"], "train.hf_args.beta: Input should be a valid number"),
        (["train.hf_args={bta: 0.2}"], "train.hf_args.bta: not a field of trl.DPOConfig (did you mean 'beta'?)"),
    ],
)
def test_what_dpo_cannot_take_is_refused_by_name_when_the_config_loads(overrides, says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DPO, ["data.format=preference", *overrides])
    assert says in str(e.value)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    storage = tmp_path_factory.mktemp("dpo") / "storage"
    overrides = {"train.max_steps": 30, "train.eval_every_steps": 15, "train.log_every_steps": 5,
                 "checkpoint.every_steps": 10}  # fmt: skip
    cfg = load_config(DPO, tiny_overrides(storage, **overrides))
    model = str(storage.parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    return cfg, stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


def train(cfg, manifest: dict, model: str, name: str, stop_at: int | None = None, lora: bool = False) -> HfTrainer:
    c = cfg.model_copy(deep=True)
    c.name = name
    if lora:
        c.model = c.model.model_copy(update={"lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}})
        c = type(c).model_validate(c.model_dump())
        c.train.lr = 0.01
    return hf_train(c, manifest, model, stop_at)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_raises_held_out_reward_accuracy_and_a_killed_run_resumes_bit_identical(setup, lora: bool) -> None:
    cfg, manifest, model = setup
    kind = "lora" if lora else "full"
    whole = train(cfg, manifest, model, f"dpo-{kind}", lora=lora)
    train(cfg, manifest, model, f"dpo-cut-{kind}", stop_at=15, lora=lora)  # checkpoint at 10, "dies" at 15
    resumed = train(cfg, manifest, model, f"dpo-cut-{kind}", lora=lora)

    assert resumed.resumed_from.endswith("checkpoint-step-00000010")
    assert weights_hash(resumed) == weights_hash(whole), (
        "TRL computed the steps; unbroken's cursor and checkpoint resumed them"
    )
    rows = [json.loads(x) for x in Path(Layout(cfg.storage).metrics(f"dpo-cut-{kind}")).read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"], r.get("eval_reward_accuracy")) for r in rows if "eval_loss" in r]
    assert evals[0][1] == pytest.approx(np.log(2)), "at step 0 the policy is the reference: DPO's loss is ln 2"
    assert evals[-1][1] < evals[0][1] and evals[-1][2] > 0.6, f"held-out pairs preferred as the set teaches: {evals}"
    assert [r["step"] for r in rows if "reward_accuracy" in r] == list(range(5, 31, 5)), "each logged step once"
