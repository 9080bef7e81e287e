"""``unbroken convert``: an Axolotl or TRL YAML written as an unbroken config that loads and passes ``unbroken check``,
every key it leaves out named with why; the config's "did you mean" for a misspelt key or another tool's name; and the
config reference's "Axolotl / TRL name" column -- all from the one table per tool (ray_jobs/config/convert.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ray_jobs.config import Config, ConfigError, load_config
from ray_jobs.config.convert import TABLES, convert
from ray_jobs.config.reference import fields, markdown
from tests.conftest import ROOT
from unbroken.cli import main

AXOLOTL = ROOT / "tests" / "data" / "axolotl-lora.yml"
DEMO_DATA = ROOT / "configs" / "data" / "addition.jsonl"  # the demo's: {"input": "35+79=", "target": "114"}
# Keys of the Axolotl recipe that unbroken does not honour: each is named, with why.
LEFT_OUT = (
    "flash_attention",
    "sample_packing",
    "pad_to_sequence_len",
    "deepspeed",
    "special_tokens",
    "optimizer",
)
TRL = {
    "model_name_or_path": "builtin:tiny-llama",
    "dataset_name": str(DEMO_DATA),
    "dataset_text_field": "text",
    "max_length": 64,
    "learning_rate": 1.0e-4,
    "num_train_epochs": 3.0,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 5,
    "weight_decay": 0.01,
    "max_grad_norm": 0.5,
    "seed": 7,
    "bf16": True,
    "gradient_checkpointing": True,
    "use_peft": True,
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "lora_target_modules": "all-linear",
    "logging_steps": 5,
    "save_steps": 20,
    "save_total_limit": 2,
    "output_dir": "trl-out",
    "report_to": ["tensorboard"],
    "eval_strategy": "epoch",
    "save_strategy": "steps",
    "packing": True,
    "push_to_hub": True,
    "frobnicate": 1,
}


def test_an_axolotl_lora_recipe_converts_to_a_config_that_passes_check(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # output_dir (./outputs/lora-out) is relative to where the command runs
    assert main(["convert", str(AXOLOTL), "-o", "run.yaml"]) == 0
    out = capsys.readouterr().out
    cfg = load_config("run.yaml")
    assert (cfg.name, cfg.model.name_or_path, cfg.data.train) == ("axolotl-lora", "builtin:tiny-llama", str(DEMO_DATA))
    assert (cfg.data.format, cfg.data.input_field, cfg.data.target_field) == ("pairs", "input", "target")
    assert (cfg.data.seq_len, cfg.data.eval_fraction) == (64, 0.05)
    lora = cfg.model.lora
    assert lora is not None and (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (
        16,
        32,
        0.05,
        ["q_proj", "v_proj"],
    )
    t = cfg.train
    assert (t.epochs, t.micro_batch_size, t.grad_accum_steps, t.lr, t.lr_schedule) == (1, 8, 2, 2e-4, "cosine")
    assert (t.warmup_steps, t.precision, t.gradient_checkpointing, t.log_every_steps) == (10, "auto", True, 10)
    assert (t.evals_per_epoch, cfg.checkpoint.saves_per_epoch) == (4, 1)
    assert cfg.tracking.wandb is not None and cfg.tracking.wandb.project == "addition"
    assert cfg.storage == str(tmp_path / "outputs" / "lora-out")
    assert "learning_rate -> train.lr = 0.0002" in out and "num_epochs -> train.epochs = 1" in out, out
    for key in LEFT_OUT:
        assert f"\n  {key}: not " in out, (key, out)  # "not needed: ..." / "not supported: ..."
    assert "left out: " in Path("run.yaml").read_text().lower()
    assert main(["check", "run.yaml"]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.rstrip().endswith("no problem found")


def test_a_trl_sft_config_converts_beside_itself(tmp_path, capsys) -> None:
    source = tmp_path / "sft.yaml"
    source.write_text(yaml.safe_dump(TRL))
    assert main(["convert", str(source)]) == 0
    out = capsys.readouterr().out
    cfg = load_config(tmp_path / "sft.unbroken.yaml")
    lora = cfg.model.lora
    assert lora is not None and (lora.r, lora.alpha, lora.target_modules) == (8, 16, "all-linear")
    t = cfg.train
    assert (t.epochs, t.micro_batch_size, t.grad_accum_steps, t.lr, t.lr_schedule) == (3, 4, 2, 1e-4, "constant")
    assert (t.seed, t.precision, t.warmup_steps, t.weight_decay, t.max_grad_norm) == (7, "bf16", 5, 0.01, 0.5)
    assert (t.log_every_steps, cfg.checkpoint.every_steps, cfg.checkpoint.num_to_keep) == (5, 20, 2)
    assert (cfg.data.train, cfg.data.format, cfg.data.seq_len) == (str(DEMO_DATA), "auto", 64)
    assert cfg.tracking.tensorboard is not None and cfg.name == "sft"
    assert (t.evals_per_epoch, t.eval_every_steps, cfg.checkpoint.saves_per_epoch) == (1, 50, None)
    assert "push_to_hub: not supported" in out and "packing: not needed" in out
    assert "not recognised" in out and "frobnicate" in out


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"type": "alpaca"}, {"format": "alpaca"}),
        ({"type": "sharegpt:chatml"}, {"format": "sharegpt"}),
        ({"type": "chat_template", "field_messages": "conversation"}, {"format": "chat", "messages_field": "conversation"}),
        ({"type": "completion", "field": "body"}, {"format": "text", "text_field": "body"}),
        ({"type": {"field_instruction": "q", "field_output": "a"}}, {"format": "pairs", "input_field": "q", "target_field": "a"}),
        ({}, {"format": "auto"}),
        ({"type": "input_output"}, "not supported: input_output's segments"),
        ({"type": {"field_instruction": "q", "field_output": "a", "format": "[INST] {instruction} [/INST]"}},
         "not supported: datasets[0].type: a prompt template"),
        ({"type": "oasst"}, "not supported: datasets[0].type 'oasst'"),
        ({"type": "chat_template", "message_property_mappings": {"role": "from", "content": "value"}},
         "not supported: datasets[0]: messages keyed"),
    ],
)  # fmt: skip
def test_each_axolotl_dataset_type_becomes_a_data_format_or_is_refused_with_why(entry, expected) -> None:
    source = {"base_model": "builtin:tiny-llama", "datasets": [{"path": "addition.jsonl", **entry}]}
    result = convert(source, "axolotl", DEMO_DATA.parent, "x")
    if isinstance(expected, str):
        assert [k for k, _ in result.dropped] == ["datasets"] and expected in result.dropped[0][1], result.dropped
        return
    assert result.tree["data"] == {"train": str(DEMO_DATA), **expected}


def test_several_datasets_are_a_mixture_and_a_hub_id_a_hub_source(tmp_path) -> None:
    entries = [
        {"path": "addition.jsonl", "type": "completion"},
        {"path": "org/chats", "type": "chat_template", "split": "train_sft", "name": "en"},
    ]
    result = convert({"base_model": "builtin:tiny-llama", "datasets": entries}, "axolotl", DEMO_DATA.parent, "mix")
    assert result.tree["data"]["train"] == [
        {"path": str(DEMO_DATA), "weight": 1, "format": "text"},
        {"hub": "org/chats", "split": "train_sft", "subset": "en", "weight": 1, "format": "chat"},
    ]
    assert any("mixture of 2 sources" in note for _, note in result.notes)
    cfg = load_config(None, [f"storage={tmp_path}", "name=mix", f"data.train={result.tree['data']['train']}"])
    assert not isinstance(cfg.data.train, str) and len(cfg.data.train) == 2


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("train.lr_rate=1", "train.lr_rate: unknown key (did you mean train.lr?)"),
        ("train.max_stepz=5", "train.max_stepz: unknown key (did you mean train.max_steps?)"),
        ("train.batch_size=4", "train.batch_size: unknown key (did you mean train.micro_batch_size?)"),
        ("cluster.num_worker=2", "(did you mean cluster.num_workers?)"),
        ("model.lora.alfa=2", "model.lora.alfa: unknown key (did you mean model.lora.alpha?)"),
        ("tracking.wandb.projekt=x", "(did you mean tracking.wandb.project?)"),
        ("train.seq_len=64", "train.seq_len: unknown key (did you mean data.seq_len?)"),
        ("train.learning_rate=1", "(did you mean train.lr? learning_rate is Axolotl's and TRL's name)"),
        ("num_epochs=1", "num_epochs: unknown key (Axolotl's name; unbroken's is train.epochs)"),
        ("num_train_epochs=1", "num_train_epochs: unknown key (TRL's name; unbroken's is train.epochs)"),
        ("sequence_len=64", "(Axolotl's name; unbroken's is data.seq_len)"),
        ("base_model=x", "(Axolotl's name; unbroken's is model.name_or_path)"),
        ("lora_r=8", "lora_r: unknown key (Axolotl's and TRL's name; unbroken's is model.lora.r)"),
        ("deepspeed=z.json", "deepspeed: unknown key (Axolotl's and TRL's key; not supported: DeepSpeed owns"),
        ("surprise=1", "surprise: unknown key"),
    ],
)
def test_an_unknown_key_says_what_was_meant(override, said) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "demo.yaml", [override])
    assert said in str(e.value)
    assert "unbroken convert" not in str(e.value), "an unbroken config with a stray key is not another tool's"


def test_an_axolotl_config_checked_as_it_is_names_unbrokens_field_for_each_key(capsys) -> None:
    assert main(["check", str(AXOLOTL)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == f"  - Axolotl's keys: `unbroken convert {AXOLOTL}` writes unbroken's config from Axolotl's"
    for line in (
        "num_epochs: unknown key (Axolotl's name; unbroken's is train.epochs)",
        "learning_rate: unknown key (Axolotl's and TRL's name; unbroken's is train.lr)",
        "flash_attention: unknown key (Axolotl's key; not needed: ",
        "output_dir: unknown key (did you mean storage? output_dir is Axolotl's and TRL's name)",
    ):
        assert any(line in e for e in err), (line, err)


def test_every_row_names_a_field_of_the_config_and_the_reference_shows_it() -> None:
    names = {f.name for f in fields(Config)}
    rows = [(tool, r) for tool, table in TABLES.items() for r in table]
    assert not [(t, r.key, r.field) for t, r in rows if r.field is not None and r.field not in names]
    assert not [(t, r.key) for t, r in rows if r.field is None and not r.note.startswith(("not needed", "not sup"))]
    page = markdown(Config)
    assert "| `train.epochs` | int \\| none | none | `num_epochs` (Axolotl), `num_train_epochs` (TRL) |" in page
    assert "| `train.lr` | float | 0.0003 | `learning_rate` |" in page


@pytest.mark.parametrize(
    ("setup", "argv", "said"),
    [
        (None, ["missing.yml"], "cannot read missing.yml"),
        ("a: [unclosed\n", ["in.yml"], "in.yml:2: not valid YAML"),
        ("- a\n- b\n", ["in.yml"], "not a YAML mapping"),
        ("name: x\nstorage: y\n", ["in.yml"], "cannot tell whose config it is"),
        ("base_model: builtin:tiny-llama\n", ["in.yml", "-o", "in.yml", "--force"], "that is the file converted"),
        ("base_model: builtin:tiny-llama\n", ["in.yml", "-o", "taken.yaml"], "taken.yaml exists; --force overwrites"),
    ],
)
def test_a_file_that_cannot_be_converted_is_one_message_and_exit_2(
    setup, argv, said, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        Path("in.yml").write_text(setup)
    Path("taken.yaml").write_text("kept")
    assert main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert Path("taken.yaml").read_text() == "kept"


def test_unknown_from_is_refused_and_force_overwrites(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    Path("in.yml").write_text(f"model_name_or_path: builtin:tiny-llama\ndataset_name: {DEMO_DATA}\n")
    with pytest.raises(SystemExit) as e:
        main(["convert", "in.yml", "--from", "llamafactory"])
    assert e.value.code == 2
    Path("in.unbroken.yaml").write_text("old")
    assert main(["convert", "in.yml", "--from", "trl", "--force"]) == 0
    assert load_config("in.unbroken.yaml").model.name_or_path == "builtin:tiny-llama"


def test_a_value_out_of_range_is_written_and_its_problem_named_with_exit_2(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    Path("in.yml").write_text(
        f"base_model: builtin:tiny-llama\ndatasets: [{{path: {DEMO_DATA}, type: alpaca}}]\n"
        "adapter: lora\nlora_dropout: 1.5\n"
    )
    assert main(["convert", "in.yml"]) == 2
    err = capsys.readouterr().err
    assert "in.unbroken.yaml does not load as written" in err and "model.lora.dropout" in err, err
    assert yaml.safe_load(Path("in.unbroken.yaml").read_text())["model"]["lora"]["dropout"] == 1.5


def test_convert_starts_neither_prefect_nor_ray_nor_torch(tmp_path) -> None:
    code = (
        "import sys; from unbroken.cli import main; "
        f"assert main(['convert', {str(AXOLOTL)!r}, '-o', {str(tmp_path / 'run.yaml')!r}]) == 0; "
        "print(sorted(m for m in ('torch', 'prefect', 'ray', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr
