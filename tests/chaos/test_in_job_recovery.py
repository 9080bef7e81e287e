"""Ray Train recovers inside one job: a killed or preempted worker costs no correctness.

Each scenario runs the real job on a real local cluster, breaks it with a real signal, and checks the final
weights are bit-identical to an uninterrupted run of the same config (same seed, same world size).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.storage import Layout
from tests.chaos.harness import (
    CHAOS_PORT,
    REPORT,
    actor_classes,
    baseline_metrics,
    chaos_config,
    final_weights_hash,
    first_checkpoint,
    heartbeat,
    heartbeat_step,
    job_logs,
    kill,
    rank0_pid,
    start_training,
    start_uninterrupted,
    train_worker_pids,
    wait_for,
    wait_job,
)
from tests.conftest import ROOT
from tests.trackers import TRACKING, check_trackers, screenshot_tensorboard, tensorboard_points

pytestmark = pytest.mark.chaos


def test_kill_9_after_the_first_checkpoint_then_sigterm_mid_interval_ends_bit_identical(
    ray_cluster, baseline, uninterrupted, tmp_path
) -> None:
    """One run, two faults (one job's worth of processes for both): kill -9 of rank 0 after the first checkpoint
    (Ray Train restarts the group from that checkpoint), then SIGTERM of the restarted rank 0 between two
    scheduled checkpoints (it saves a just-in-time checkpoint of the current step, and the next start repeats no
    step)."""
    cfg = chaos_config(tmp_path / "storage", "kill9", **TRACKING)
    ckpts = Layout(cfg.storage).checkpoints_dir(cfg.name)
    sid = start_training(ray_cluster, cfg)
    first_checkpoint(ray_cluster, cfg, sid)
    victim = rank0_pid(cfg)
    at_kill, killed_at = heartbeat_step(cfg), time.time()
    kill(victim, signal.SIGKILL)
    # The restarted group's beat: where it started, when it first stepped; then the SIGTERM past step 125.
    beat = wait_for("the restarted group past step 125",
                    lambda: (b := heartbeat(cfg)).get("pid") != victim and b.get("step", 0) > 125 and b)  # fmt: skip
    kill(beat["pid"], signal.SIGTERM)
    REPORT.append({"scenario": "kill -9 a train worker", "detected_by": "Ray Train (in job)", "detection_s": None,
                   "recovery_s": beat["first_step_at"] - killed_at,
                   "lost_steps": max(0, at_kill - beat["started_step"])})  # fmt: skip

    assert wait_job(ray_cluster, sid) == "SUCCEEDED", job_logs(ray_cluster, sid)[-5000:]
    logs = job_logs(ray_cluster, sid)
    (tmp_path / "job.log").write_text(logs)  # kept by pytest for a look after a failure
    first = re.search(r"rank 0: resumed from \S+checkpoint-step-(\d{8}) at step \d+", logs)
    assert first and int(first.group(1)) % cfg.checkpoint.every_steps == 0, logs[-5000:]
    assert victim not in train_worker_pids(CHAOS_PORT)
    jit = re.search(r"just-in-time checkpoint at step (\d+) saved", logs)
    assert jit, logs[-5000:]
    step = int(jit.group(1))
    assert step % cfg.checkpoint.every_steps != 0, "the JIT checkpoint is for the current step, not a scheduled one"
    assert ckpt.read_verified(str(Path(ckpts) / ckpt.checkpoint_name(step)))
    # (not "after the first 'just-in-time'": the controller's traceback quoting it may come before the worker's line)
    resumed = rf"rank 0: resumed from \S+{ckpt.checkpoint_name(step)} at step {step} "
    assert re.search(resumed, logs), f"the restart resumed from the JIT checkpoint: {logs[-5000:]}"
    attempts = [tuple(map(int, m)) for m in re.findall(r"this attempt trained steps (\d+)\.\.(\d+)", logs)]
    assert attempts == [(step + 1, cfg.train.max_steps)], "after the restart, training starts at the next step"
    assert final_weights_hash(cfg) == baseline
    # TensorBoard and MLflow: one run each, each step once, the uninterrupted run's values (which it showed too).
    check_trackers(cfg.storage, cfg.name, cfg.series_name, baseline_metrics(uninterrupted))
    check_trackers(uninterrupted[1].parent / "storage", "baseline", "baseline")
    # TensorBoard's own server gives its UI the curve once per step (the UI's picture: docs/tracking.md's screenshot)
    event_dir = Path(Layout(cfg.storage).run_dir(cfg.name)) / "tensorboard"
    shown = screenshot_tensorboard(event_dir, ROOT / ".unbroken" / "screenshots" / "tracking-tensorboard.png")
    assert shown == tensorboard_points(event_dir, "train/loss") and len(shown) == len(set(s for s, _ in shown))
    # The live metrics' restart count (ray_unbroken_restarts): the last rank 0 knew it was its attempt's third start.
    starts = json.loads(Path(Layout(cfg.storage).train_starts(cfg.name)).read_text())
    assert (starts["attempt"], starts["starts"]) == (1, 3), starts
    # The first start's workers filled the node cache; the restarted ones read nothing remotely, warming or after.
    restarted = dict(re.findall(r"rank (\d) node cache warm-up: (\{[^}]*\})", logs))  # each rank's last warm-up
    counters = re.findall(r"rank (\d) shard cache after warm-up: (\{[^}]*\})", logs)
    assert sorted(restarted) == ["0", "1"] and sorted(r for r, _ in counters) == ["0", "1"], logs[-3000:]
    for c in [*restarted.values(), *(c for _, c in counters)]:
        assert "'bytes_from_storage': 0" in c and "'misses': 0" in c, (restarted, counters)
    # Three worker groups, and not one of Ray Train's dataset managers (unbroken passes no Ray Dataset:
    # ray_jobs/ray_private.torch_trainer); its synchronization actors, one a group, for comparison.
    started = actor_classes(ray_cluster)
    assert started.get("DatasetManager", 0) == 0 and started.get("SynchronizationActor", 0) >= 3, started


@pytest.mark.full(
    shard=2
)  # a worker kill again, under FSDP (tests/unit/test_sharded_checkpoints.py: its resume, in-process)
def test_fsdp_run_killed_mid_run_ends_bit_identical_and_exports(ray_cluster, tmp_path) -> None:
    """FSDP killed after a checkpoint ends bit-identical to FSDP uninterrupted -- trained under ``torchrun`` (the
    loop Ray Train runs, without Ray: cheaper, and it trains while the killed run waits on its restart)."""
    from transformers import AutoModelForCausalLM

    fsdp = {"train.parallelism": "fsdp", "train.max_steps": 120}
    straight = start_uninterrupted(tmp_path / "a", **fsdp)
    cfg = chaos_config(tmp_path / "b", "fsdp-kill9", **fsdp)
    sid = start_training(ray_cluster, cfg)
    first_checkpoint(ray_cluster, cfg, sid)
    kill(rank0_pid(cfg), signal.SIGKILL)
    assert wait_job(ray_cluster, sid) == "SUCCEEDED", job_logs(ray_cluster, sid)[-5000:]
    assert "resumed from" in job_logs(ray_cluster, sid)
    assert final_weights_hash(cfg) == straight()[0]
    AutoModelForCausalLM.from_pretrained(Path(Layout(cfg.storage).final_model(cfg.name)))
