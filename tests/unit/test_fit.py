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
    assert "cluster.use_gpu with cluster.num_workers=8 needs 8 GPUs; the cluster has 0" in text


def test_an_elastic_run_needs_room_for_its_min_and_shards_for_its_max() -> None:
    c = cfg("cluster.num_workers={min: 2, max: 6}", "train.grad_accum_steps=30")
    text = "\n".join(check_fit(c, {"CPU": 1.0}, MANIFEST))
    assert "4 train shards but cluster.num_workers=6 (its max)" in text
    assert "cluster.num_workers.min=2 x cluster.cpus_per_worker=1.0 needs 2 CPUs; the cluster has 1" in text
    assert check_fit(cfg("cluster.num_workers={min: 1, max: 4}", "train.grad_accum_steps=3"), {"CPU": 1.0},
                     MANIFEST) == []  # fmt: skip


def test_the_preflight_waits_for_nodes_to_join_up_to_the_start_timeout_then_names_it() -> None:
    from ray_jobs.preflight import wait_for_room, workers_that_fit

    c = cfg("cluster.num_workers={min: 2, max: 4}", "train.grad_accum_steps=3", "cluster.start_timeout_s=10")
    now, seen = [0.0], []

    def sleep(s):
        now[0] += s

    def joining():  # a node joins at t=4
        seen.append(now[0])
        return {"CPU": 1.0 if now[0] < 4 else 3.0}

    assert wait_for_room(c, joining, sleep, lambda: now[0]) == [] and 4 <= now[0] < 10
    assert workers_that_fit(c, joining()) == 3
    now[0] = 0.0
    left = wait_for_room(c, lambda: {"CPU": 1.0}, sleep, lambda: now[0])
    assert now[0] == 10 and len(left) == 1
    assert left[0].endswith("needs 2 CPUs; the cluster has 1 (waited cluster.start_timeout_s=10 s)")


def test_ranks_are_predicted_as_ray_train_assigns_them_grouped_by_node_in_first_bundle_order() -> None:
    from ray_jobs.preflight import predict_ranks

    assert predict_ranks(["b", "a", "b", "a"]) == {"b": [0, 1], "a": [2, 3]}
    assert predict_ranks(["a", "a", "a"]) == {"a": [0, 1, 2]}


def test_each_node_is_warmed_with_its_ranks_train_shards_and_every_eval_shard() -> None:
    from ray_jobs.preflight import node_entries

    manifest = {"shards": {"train": MANIFEST["shards"]["train"], "eval": [{"file": "eval-00000.parquet"}]}}
    plan = node_entries(cfg(), manifest, {"n1": [0], "n2": [1]}, world=2)
    assert [e["file"] for e in plan["n1"]] == ["train-00000.parquet", "train-00002.parquet", "eval-00000.parquet"]
    assert [e["file"] for e in plan["n2"]] == ["train-00001.parquet", "train-00003.parquet", "eval-00000.parquet"]
    shrunk = node_entries(cfg(), manifest, {"n1": [0]}, world=1)  # one worker serves both data ranks
    assert [e["file"] for e in shrunk["n1"]][:4] == [f"train-0000{i}.parquet" for i in (0, 2, 1, 3)]
