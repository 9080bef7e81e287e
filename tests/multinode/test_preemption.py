"""A preemption notice (a node drained with a deadline, as a spot reclaim gives one): every rank checkpoints the step
it is at, the group waits for Ray Train's restart, the cloud takes the node at the deadline, and the run resumes on the
spare host from that checkpoint -- no step lost, the preemption counted apart from failures, the end bit-identical."""

from __future__ import annotations

import re
import time

import pytest

import ray_jobs.checkpoint as ckpt
from ray_jobs.storage import Layout
from tests.chaos.harness import REPORT, chaos_config, final_weights_hash, heartbeat, job_logs, start_training, wait_job
from tests.procs import wait_for

pytestmark = pytest.mark.multinode

DEADLINE_S = 30


def test_a_drained_worker_host_checkpoints_at_once_loses_no_step_and_counts_as_a_preemption(
    hosts, cluster, baseline, tmp_path
) -> None:
    # No failure budget at all: were the preemption counted as a failure, the job would fail.
    cfg = chaos_config(tmp_path / "storage", "drain", **{"fault_tolerance.max_failures": 0,
                                                        "fault_tolerance.max_preemptions": 1})  # fmt: skip
    sid = start_training(cluster, cfg, env={"UNBROKEN_INJECT_DELAY": "step:0.1"})
    wait_for("the first checkpoint", lambda: ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(cfg.name)))
    training = hosts.training_hosts()
    (spare,) = [h for h in hosts.hosts[1:] if h not in training]
    victim = training[-1]
    drained_at = time.time()
    hosts.drain(victim, DEADLINE_S)

    beat = wait_for("the group to checkpoint and wait", lambda: (b := heartbeat(cfg))["phase"] == "preempted" and b,
                    timeout_s=DEADLINE_S)  # fmt: skip
    noticed_s, jit_step = beat["phase_started_at"] - drained_at, beat["step"]
    assert jit_step < cfg.train.max_steps
    assert ckpt.check(f"{Layout(cfg.storage).checkpoints_dir(cfg.name)}/{ckpt.checkpoint_name(jit_step)}")
    time.sleep(max(0.0, drained_at + DEADLINE_S - time.time()))
    lost = heartbeat(cfg)["step"] - jit_step
    assert lost == 0, "no step trained while waiting for the restart (it would be thrown away)"
    hosts.kill(victim)  # the cloud takes the node at the deadline
    wait_for("a training worker on the spare host", lambda: spare in hosts.training_hosts(), timeout_s=180)

    assert wait_job(cluster, sid) == "SUCCEEDED", job_logs(cluster, sid)[-5000:]
    logs = job_logs(cluster, sid)
    saved = re.findall(r"just-in-time checkpoint at step (\d+) saved \(drain notice", logs)
    assert saved and {int(s) for s in saved} == {jit_step}, "every rank checkpointed the same step, once"
    end = heartbeat(cfg)
    assert end["started_step"] == jit_step, "the restarted group resumed from the just-in-time checkpoint"
    row = {"scenario": f"drain a worker host, {DEADLINE_S} s deadline (N+1)", "detected_by": "Ray Train preemption "
           "notice", "detection_s": noticed_s, "recovery_s": end["first_step_at"] - drained_at, "lost_steps": lost}  # fmt: skip
    REPORT.append(row)
    print("MULTINODE", row)
    assert final_weights_hash(cfg) == baseline
    hosts.start_worker(victim)
