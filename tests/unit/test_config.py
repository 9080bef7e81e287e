"""Config: one typed tree, every bad field named in one error, nothing touched before validation passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ray_jobs.config import Config, ConfigError, load_config, parse_overrides
from tests.conftest import ROOT

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_validates(preset: Path) -> None:
    cfg = load_config(preset)
    assert isinstance(cfg, Config)


def test_demo_is_the_embedded_default_shape() -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert cfg.model.name_or_path == "builtin:tiny-llama"
    assert cfg.cluster.address == ""
    assert cfg.cluster.num_workers == 2
    assert Path(cfg.storage).is_absolute(), "relative storage paths are made absolute for the cluster"
    assert Path(cfg.data.train).is_file()


def test_all_bad_fields_are_reported_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: Bad_Name\n"
        "storage: nosuchproto://bucket\n"
        "data: {train: x.jsonl, seq_len: 2, max_reject_fraction: 1.5}\n"
        "train: {lr: -1, max_steps: 0, optimiser: adam}\n"
        "cluster: {address: 'head:8265', num_workers: 0}\n"
        "surprise: 1\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    text = str(err.value)
    for field in (
        "name:",
        "storage:",
        "data.seq_len:",
        "data.max_reject_fraction:",
        "train.lr:",
        "train.max_steps:",
        "train.optimiser: unknown key",
        "cluster.address:",
        "cluster.num_workers:",
        "surprise: unknown key",
    ):
        assert field in text, f"{field!r} missing from:\n{text}"
    assert len(err.value.problems) == 10


def test_missing_required_fields_are_named() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [])
    assert {p.split(":")[0] for p in err.value.problems} == {"name", "storage", "data"}


def test_overrides_are_typed_and_nested(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["train.max_steps=7", "cluster.use_gpu=true", f"storage={tmp_path}", "data.eval_fraction=0.1"],
    )
    assert cfg.train.max_steps == 7
    assert cfg.cluster.use_gpu is True
    assert cfg.data.eval_fraction == 0.1
    assert cfg.storage == str(tmp_path)


def test_override_of_unknown_field_is_named() -> None:
    with pytest.raises(ConfigError, match=r"train\.max_stepz: unknown key"):
        load_config(ROOT / "configs" / "demo.yaml", ["train.max_stepz=7"])


def test_malformed_override_is_explained() -> None:
    tree, problems = parse_overrides(["train.max_steps"])
    assert tree == {} and "expected KEY=VALUE" in problems[0]


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: x\nstorage: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+: not valid YAML"):
        load_config(bad)


def test_tiny_model_heads_must_divide_width() -> None:
    with pytest.raises(ConfigError, match=r"model\.tiny.*num_heads \(3\) must divide hidden_size \(64\)"):
        load_config(ROOT / "configs" / "demo.yaml", ["model.tiny.num_heads=3", "model.tiny.hidden_size=64"])


def test_s3_storage_is_accepted_as_is() -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["storage=s3://bucket/prefix"])
    assert cfg.storage == "s3://bucket/prefix"


def test_mlflow_on_an_object_store_needs_a_tracking_uri() -> None:
    demo = ROOT / "configs" / "demo.yaml"
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.tracking_uri: required when storage is an object store"):
        load_config(demo, ["storage=s3://bucket/prefix", "tracking.mlflow=true"])
    named = load_config(demo, ["storage=s3://bucket/prefix", "tracking.mlflow.tracking_uri=http://mlflow:5000"])
    assert named.tracking.mlflow.tracking_uri == "http://mlflow:5000"
    assert load_config(demo, ["tracking.mlflow=true"]).tracking.mlflow.tracking_uri is None  # local: SQLite default


def test_cli_rejects_bad_config_before_touching_storage_or_prefect(tmp_path: Path) -> None:
    storage = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-m", "unbroken", "run", str(ROOT / "configs" / "demo.yaml"),
         "--set", f"storage={storage}", "--set", "train.lr=0", "--set", "cluster.num_workers=-1",
         "--set", "data.bogus=1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    for field in ("train.lr", "cluster.num_workers", "data.bogus: unknown key"):
        assert field in proc.stderr
    assert not storage.exists(), "nothing may be written to storage for a bad config"
    assert "Starting temporary server" not in proc.stdout + proc.stderr, "Prefect must not start for a bad config"
