"""An elastic run (``cluster.num_workers: {min: 1, max: 2}``) on two worker hosts, no spare: one host killed and not
replaced, the run goes on with one worker (the global batch kept: it runs both data ranks' micro-batches); when a
host joins again Ray Train grows the group back to two at its next resize check. Whatever the world size did, the run
trains every (epoch, row) of the uninterrupted two-worker run exactly as often."""

from __future__ import annotations

import time

import pytest

import ray_jobs.checkpoint as ckpt
from ray_jobs.storage import Layout
from ray_jobs.train import rowtrace
from tests.chaos.harness import REPORT, chaos_config, heartbeat, heartbeat_step, job_logs, start_training, wait_job
from tests.hosts import wait_gone
from tests.procs import wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.full(shard=0)]  # a host lost: proven in make test by test_node_loss


def test_an_elastic_run_shrinks_to_one_worker_grows_back_and_trains_every_row_exactly_once(
    hosts, cluster, baseline_run, tmp_path
) -> None:
    _, baseline_rows = baseline_run
    absent = hosts.hosts[3]  # no spare: two worker hosts only
    hosts.kill(absent)
    wait_gone(hosts, absent)
    rows = tmp_path / "rows"
    cfg = chaos_config(tmp_path / "storage", "elastic", **{"cluster.num_workers": "{min: 1, max: 2}",
                                                          "cluster.resize_check_s": 10})  # fmt: skip
    victim = absent
    sid = start_training(cluster, cfg, env={"UNBROKEN_INJECT_DELAY": "step:0.3", rowtrace.ENV: str(rows)})
    try:
        ckpts = Layout(cfg.storage).checkpoints_dir(cfg.name)
        wait_for("the first checkpoint", lambda: ckpt.find_latest_valid(ckpts))
        training = hosts.training_hosts()
        assert len(training) == 2
        victim, survivor = training
        at_kill, killed_at = heartbeat_step(cfg), time.time()
        hosts.kill(victim)
        detection = wait_gone(hosts, victim)
        shrunk_beat = wait_for("a new step at world size 1", lambda: (b := heartbeat(cfg))["first_step_at"]
                               and b["first_step_at"] > killed_at and b, timeout_s=120)  # fmt: skip
        assert hosts.training_hosts() == [survivor], "one worker, on the host left"
        # The world-1 group's steps count only once it checkpointed them: a host joining before that would let the
        # group grow back and redo them at world 2 (seen once: worlds [2, 2]). Let it join only after the event.
        wait_for("a checkpoint written by the world-1 group", lambda: (c := ckpt.find_latest_valid(ckpts))
                 and c[1].world_size == 1 and c[1].step > shrunk_beat["started_step"], timeout_s=120)  # fmt: skip
        assert heartbeat_step(cfg) < cfg.train.max_steps - 40, "enough of the run left to grow back"
        back_at = time.time()
        hosts.start_worker(absent)  # a host joins: the next resize check grows the group
        wait_for("the group grown back to two workers", lambda: len(hosts.training_hosts()) == 2, timeout_s=120)
        grown_s = time.time() - back_at
        assert wait_job(cluster, sid) == "SUCCEEDED", job_logs(cluster, sid)[-5000:]
    finally:
        for h in {victim.name: victim, absent.name: absent}.values():
            if h.addr not in hosts.alive_nodes():
                hosts.start_worker(h)  # the next test finds N+1 again
    want, _ = rowtrace.trained_rows(baseline_rows)
    got, worlds = rowtrace.trained_rows(rows)
    assert got == want, "every (epoch, row) of the uninterrupted 2-worker run, each exactly as often"
    assert [w for w, _, _ in worlds] == [2, 1, 2], worlds
    assert worlds[-1][2] == cfg.train.max_steps
    row = {"scenario": "elastic {min 1, max 2}: kill a worker host, no spare; a host back later",
           "detected_by": "Ray (node death)", "detection_s": detection,
           "recovery_s": shrunk_beat["first_step_at"] - killed_at,
           "lost_steps": max(0, at_kill - shrunk_beat["started_step"]), "grow_back_s": grown_s,
           "world_sizes": " -> ".join(f"{w} (steps {lo}-{hi})" for w, lo, hi in worlds)}  # fmt: skip
    REPORT.append(row)
    print("MULTINODE", row)
