"""The model probe's answer, remembered: read back for the same model section (and config.json), probed again for
any other; a torn cache file is a miss."""

from __future__ import annotations

import json

import pytest

from control.check import probes, remembered
from ray_jobs.config import load_config
from tests.conftest import ROOT, tiny_overrides


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UNBROKEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "model-probes"


def demo(tmp_path, **extra):
    return load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(tmp_path / "s", **extra))


def test_a_model_probed_once_is_read_back_and_another_is_probed(tmp_path, cache, monkeypatch) -> None:
    cfg = demo(tmp_path)
    found, shape = probes.model(cfg)
    assert shape is not None and len(list(cache.glob("*.json"))) == 1
    monkeypatch.setattr(probes, "_probe_model", lambda *a: pytest.fail("probed again"))
    assert probes.model(cfg) == (found, shape)
    monkeypatch.undo()
    monkeypatch.setenv("UNBROKEN_CACHE", str(cache.parent))
    lora = demo(tmp_path, **{"model.lora.r": 4, "model.lora.target_modules": "[q_proj, nope]"})
    found_lora, _ = probes.model(lora)
    assert any(f.problem and "nope not found" in f.text for f in found_lora), found_lora
    assert len(list(cache.glob("*.json"))) == 2
    assert probes.model(lora)[0] == found_lora, "a LoRA problem is remembered with the tree it was found in"


def test_a_local_folder_is_keyed_by_its_config_json_and_a_torn_file_is_a_miss(tmp_path, cache) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = demo(tmp_path, **{"model.name_or_path": str(folder)})
    before = remembered.key(cfg)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert remembered.key(cfg) != before
    assert remembered.key(demo(tmp_path, **{"model.name_or_path": "someone/hub-model"})) is None
    cache.mkdir(parents=True)
    (cache / f"{remembered.key(cfg)}.json").write_text('{"findings": [')
    assert remembered.recall(cfg) is None
