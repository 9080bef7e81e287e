"""The whole pipeline through the CLI: Prefect flow -> local Ray head -> Ray Jobs API -> Ray Train -> HF folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from control import registry
from control.backends.base import reachable
from ray_jobs.config import load_config
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_metrics, read_registry, run_cli
from tests.trackers import TRACKING, check_trackers

pytestmark = pytest.mark.integration
DEMO = str(ROOT / "configs" / "demo.yaml")


def sets(storage: Path, **extra: object) -> list[str]:
    return [arg for kv in tiny_overrides(storage, **extra) for arg in ("--set", kv)]


def test_run_end_to_end_on_a_local_head_and_load_the_model(tmp_path: Path) -> None:
    from prefect.artifacts import Artifact
    from transformers import AutoModelForCausalLM, AutoTokenizer

    storage = tmp_path / "storage"
    r = run_cli("run", DEMO, *sets(storage, name="e2e", **TRACKING))  # TensorBoard and MLflow (SQLite) on
    assert r.returncode == 0, r.explain()

    final = storage / "runs" / "e2e" / "final"
    assert r.last_line == f"final model: {final}"
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    out = model.generate(**tok("<s>12+30=", add_special_tokens=False, return_tensors="pt"), max_new_tokens=4)
    assert out.shape[1] > 5

    evals = [m["eval_loss"] for m in read_metrics(storage, "e2e") if "eval_loss" in m]
    assert evals[-1] < evals[0], "eval loss must fall"
    assert "eval loss:" in r.stdout and "at step 0 ->" in r.stdout

    logs = r.stdout + r.stderr  # Prefect's console log goes to stderr
    warmed = dict(re.findall(r"rank (\d) node cache warm-up: (\{[^}]*\})", logs))
    after = re.findall(r"rank \d shard cache after warm-up: (\{[^}]*\})", logs)
    assert sorted(warmed) == ["0", "1"], logs[-3000:]
    assert all("'misses': 0" not in w for w in warmed.values()), (
        "each worker filled the cold node cache with its shards"
    )
    assert len(after) == 2 and all("'bytes_from_storage': 0" in w for w in after), "training read only the cache"
    assert "check-cluster-fits" in logs and "unbroken-e2e-preflight" not in logs, "no Ray job before training's"

    reg = read_registry(storage, "e2e")
    assert reg["state"] == "succeeded"
    assert [a["submission_id"] for a in reg["attempts"]] == [registry.submission_id(reg["config"]["storage"], "e2e", 1)]
    assert reg["final_model"] == str(final)
    ckpts = sorted((storage / "ray" / "e2e").glob("checkpoint-step-*"))
    assert ckpts and all((c / "manifest.json").exists() for c in ckpts), "checkpoints with manifests"
    beat = json.loads((storage / "runs" / "e2e" / "heartbeat.json").read_text())
    assert beat["step"] == beat["max_steps"] == 30
    assert reachable("http://127.0.0.1:8265") is not None, "the local head this flow started must be stopped"

    # Each tracker: one run, each logged step once, the metrics log's values; the flow's artifacts link them.
    check_trackers(storage, "e2e", load_config(DEMO, tiny_overrides(storage, name="e2e")).series_name)
    links = Artifact.get("e2e-tracking")
    assert links is not None and f"`{storage / 'runs' / 'e2e' / 'tensorboard'}`" in links.data, links
    assert "mlflow ui --backend-store-uri sqlite:///" in links.data, links.data


def test_stage_command_prints_the_dataset_and_restaging_is_a_cache_hit(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    first = run_cli("stage", DEMO, *sets(storage))
    assert first.returncode == 0, first.explain()
    ds_line, manifest_line, staged_line = first.stdout.strip().splitlines()[-3:]
    dataset_id = ds_line.removeprefix("dataset id: ")
    assert dataset_id.startswith("ds-") and "cache hit" not in ds_line
    assert manifest_line == f"manifest: {storage / 'datasets' / dataset_id / 'manifest.json'}"
    assert staged_line.startswith("staged: ") and "records (0 rejected)" in staged_line, first.explain()
    again = run_cli("stage", DEMO, *sets(storage))
    assert again.returncode == 0 and f"dataset id: {dataset_id} (cache hit)" in again.stdout, again.explain()


def test_bad_data_fails_the_stage_command_naming_file_and_line(tmp_path: Path, monkeypatch) -> None:
    """A user's mistake found inside a flow (staging, on data past the size the command reads in full first): its
    message once, exit 2, no Prefect traceback (unbroken/errors.py)."""
    monkeypatch.setenv("UNBROKEN_EARLY_SCAN_MB", "0")
    src = tmp_path / "bad.jsonl"
    src.write_text('{"input": "1+1=", "target": "2"}\n{"input": "2+2="}\n')
    r = run_cli("stage", DEMO, *sets(tmp_path / "storage", **{"data.train": src}))
    assert r.returncode == 2, r.explain()
    assert f"{src}:2: missing field 'target'" in r.stderr, r.explain()
    assert "Traceback" not in r.stderr and r.stderr.count(f"{src}:2:") == 1, r.explain()
    said = r.stderr[r.stderr.index("error: ") :].splitlines()
    assert said[0].startswith("error: 1 of 2 records rejected") and len(said) <= 4, (
        r.explain()
    )  # + Prefect's "Stopping"
