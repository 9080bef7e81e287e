"""A run that could never start is refused before its attempt is recorded, with every reason named
(control/backends/fit.py): a dataset without a shard per data rank, a cluster without room for the fewest workers."""

from __future__ import annotations

from control.backends.fit import check_fit, resources, wait_for_room
from control.backends.health import Health, Node
from ray_jobs.config import load_config
from tests.conftest import ROOT, made_manifest

MANIFEST = made_manifest(train_shards=4)


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


def test_the_resources_counted_are_the_alive_nodes_as_the_dashboard_reports_them() -> None:
    nodes = [Node("a", "10.0.0.1", True, True, cpus=0), Node("b", "10.0.0.2", True, False, cpus=1, gpus=1),
             Node("c", "10.0.0.3", False, False, cpus=8, gpus=8)]  # fmt: skip
    assert resources(Health(nodes)) == {"CPU": 1.0, "GPU": 1.0}


def test_a_run_waits_for_nodes_to_join_up_to_the_start_timeout_then_names_it() -> None:
    c = cfg("cluster.num_workers={min: 2, max: 4}", "train.grad_accum_steps=3", "cluster.start_timeout_s=10")
    now = [0.0]

    def sleep(s):
        now[0] += s

    def joining():  # a node joins at t=4
        return {"CPU": 1.0 if now[0] < 4 else 3.0}

    assert wait_for_room(c, joining, sleep, lambda: now[0]) == [] and 4 <= now[0] < 10
    now[0] = 0.0
    left = wait_for_room(c, lambda: {"CPU": 1.0}, sleep, lambda: now[0])
    assert now[0] == 10 and len(left) == 1
    assert left[0].endswith("needs 2 CPUs; the cluster has 1 (waited cluster.start_timeout_s=10 s)")
