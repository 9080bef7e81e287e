"""Preflight: a job that could never start is refused up front, with every reason named."""

from __future__ import annotations

from ray_jobs.config import load_config
from ray_jobs.preflight import check_fit
from tests.conftest import ROOT

MANIFEST = {"shards": {"train": [{"file": f"train-{i:05d}.parquet"} for i in range(4)], "eval": []}}


def cfg(*overrides: str):
    return load_config(ROOT / "configs" / "demo.yaml", list(overrides))


def test_a_job_that_fits_passes() -> None:
    assert check_fit(cfg(), {"CPU": 2.0}, MANIFEST) == []


def test_every_reason_a_job_cannot_start_is_named() -> None:
    problems = check_fit(cfg("cluster.num_workers=8", "cluster.use_gpu=true"), {"CPU": 4.0}, MANIFEST)
    text = "\n".join(problems)
    assert "4 train shards but cluster.num_workers=8" in text and "data.min_shards" in text
    assert "needs 8 CPUs; the cluster has 4" in text
    assert "cluster.use_gpu needs 8 GPUs; the cluster has 0" in text


def test_ranks_are_predicted_as_ray_train_assigns_them_grouped_by_node_in_first_bundle_order() -> None:
    from ray_jobs.preflight import predict_ranks

    assert predict_ranks(["b", "a", "b", "a"]) == {"b": [0, 1], "a": [2, 3]}
    assert predict_ranks(["a", "a", "a"]) == {"a": [0, 1, 2]}


def test_each_node_is_warmed_with_its_ranks_train_shards_and_every_eval_shard() -> None:
    from ray_jobs.preflight import node_entries

    manifest = {"shards": {"train": MANIFEST["shards"]["train"], "eval": [{"file": "eval-00000.parquet"}]}}
    plan = node_entries(manifest, {"n1": [0], "n2": [1]}, world=2)
    assert [e["file"] for e in plan["n1"]] == ["train-00000.parquet", "train-00002.parquet", "eval-00000.parquet"]
    assert [e["file"] for e in plan["n2"]] == ["train-00001.parquet", "train-00003.parquet", "eval-00000.parquet"]
