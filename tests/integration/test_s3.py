"""s3:// storage for real: a moto S3 server over HTTP; staging, shard reads, and a whole run through it."""

from __future__ import annotations

import json

import fsspec
import pytest

from ray_jobs.config import load_config
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA, tiny_overrides
from tests.integration.conftest import run_cli
from tests.s3 import SECRET, make_bucket, moto_server

pytestmark = pytest.mark.integration
DEMO = str(ROOT / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def bucket():
    with moto_server():
        root = make_bucket("unbroken-it")
        fs = fsspec.filesystem("s3")
        fs.put_file(str(SAMPLE_DATA), f"{root}/data/addition.jsonl")
        yield root


def test_stage_from_and_to_s3_then_read_shards_through_the_cache(bucket, tmp_path) -> None:
    cfg = load_config(
        DEMO,
        tiny_overrides(tmp_path, storage=f"{bucket}/stage-test", **{"data.train": f"{bucket}/data/addition.jsonl"}),
    )
    model = tmp_path / "model"
    build_builtin(cfg.model, 0, model)
    tok = load_tokenizer(str(model))
    first = stage(cfg.data, tok, str(model), cfg.storage)
    assert not first.cache_hit
    assert first.manifest_url == f"{bucket}/stage-test/datasets/{first.dataset_id}/manifest.json"
    assert first.manifest["sources"]["train"][0]["url"] == f"{bucket}/data/addition.jsonl"
    again = stage(cfg.data, tok, str(model), cfg.storage)
    assert again.cache_hit and again.dataset_id == first.dataset_id

    entries = first.manifest["shards"]["train"]
    cold = ShardCache(cfg.storage, first.dataset_id, str(tmp_path / "cache"))
    for e in entries:
        cold.local_path(e)
    assert cold.misses == len(entries) and cold.bytes_from_storage == sum(e["bytes"] for e in entries)
    warm = ShardCache(cfg.storage, first.dataset_id, str(tmp_path / "cache"))
    for e in entries:
        warm.local_path(e)
    assert warm.counters() == {"hits": len(entries), "misses": 0, "bytes_from_storage": 0}


def test_a_whole_run_with_data_and_storage_on_s3(bucket, tmp_path) -> None:
    storage = f"{bucket}/runs-test"
    sets = tiny_overrides(tmp_path, name="s3run", storage=storage, **{"data.train": f"{bucket}/data/addition.jsonl"})
    r = run_cli("run", DEMO, *[a for kv in sets for a in ("--set", kv)])
    assert r.returncode == 0, r.explain()
    assert r.last_line == f"final model: {storage}/runs/s3run/final"

    fs = fsspec.filesystem("s3")
    files = [p for p in fs.find(bucket.removeprefix("s3://")) if not p.endswith((".parquet", ".safetensors", ".pt"))]
    assert any(p.endswith("runs/s3run/run.json") for p in files)
    assert any("/ray/s3run/checkpoint-step-" in p and p.endswith("manifest.json") for p in files)
    reg = json.loads(fs.cat(f"{storage}/runs/s3run/run.json"))
    assert reg["state"] == "succeeded"
    for p in files:
        assert SECRET.encode() not in fs.cat(p), f"credentials leaked into {p}"
    assert SECRET not in r.stdout + r.stderr, "credentials leaked into the CLI output"

    from transformers import AutoModelForCausalLM

    local = tmp_path / "final"
    fs.get(f"{storage}/runs/s3run/final/", str(local) + "/", recursive=True)
    AutoModelForCausalLM.from_pretrained(local)


def test_watchdog_lease_on_s3_is_exclusive(bucket) -> None:
    """The lease's exclusive create is a conditional PUT (If-None-Match: *) on S3: one winner, fencing works."""
    from control import lease as leases
    from ray_jobs.coordination import create_exclusive

    storage = f"{bucket}/lease-test"
    assert create_exclusive(f"{storage}/claim", b"a") is True
    assert create_exclusive(f"{storage}/claim", b"b") is False
    first = leases.acquire(storage, "r", owner="a", ttl_s=60)
    assert first is not None and leases.acquire(storage, "r", owner="b") is None
    first.release()
    second = leases.acquire(storage, "r", owner="b", ttl_s=60)
    assert second is not None and second.generation == 2
    second.check()
