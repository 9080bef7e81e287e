"""Live recovery (``fault_tolerance.live_recovery``): a lost worker is replaced while the other keeps training.

One real job on the chaos suite's head (Ray Train + torchft, two replicas) takes three faults: kill -9 of the replica
that leads (it writes the heartbeat, the metrics and the checkpoints), then SIGTERM of a worker -- the survivor steps
on alone, computing the lost replica's share too, and the replacement heals from it -- then SIGTERM of every worker at
once: the leader saves the step they all left at, and the next group resumes from it. The run ends with the uninterrupted
run's weights bit for bit, every row of it trained once, and the trackers holding each step once.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.faults import FILE_ENV
from ray_jobs.storage import Layout
from ray_jobs.train.rowtrace import ENV, trained_rows
from tests.chaos.harness import (
    CHAOS_PORT,
    REPORT,
    baseline_metrics,
    chaos_config,
    final_weights_hash,
    heartbeat,
    job_logs,
    kill,
    start_training,
    train_worker_pids,
    wait_for,
    wait_job,
)
from tests.trackers import TRACKING, check_trackers

pytestmark = pytest.mark.chaos
LIVE = {"fault_tolerance.live_recovery": True, "fault_tolerance.max_failures": 4}


def _degraded_at(logs: str, after: float) -> float:
    """When the first step trained without the lost replica was committed (the survivors log it), after ``after``."""
    for m in re.finditer(r"step \d+ trained by replicas \[\d\] of 2 \(committed at ([\d.]+)\)", logs):
        at = float(m.group(1))
        if at > after:
            return at
    raise AssertionError(f"no step trained by one replica after the fault: {logs[-5000:]}")


def test_a_killed_and_a_sigtermed_worker_are_replaced_live_and_the_run_ends_bit_identical(
    ray_cluster, baseline, uninterrupted, tmp_path
) -> None:
    cfg = chaos_config(tmp_path / "storage", "live", **TRACKING, **LIVE)
    # Each replacement must heal before the run's 240 steps end, and its start on a loaded machine (the other lane)
    # has taken from ~80 steps of 0.03 s to more than the ~150 left at 0.06 s (CI saw both). So the steps are slow
    # only while a replacement starts (the workers read the delay file again when it changes; a sleep changes no
    # number): 0.5 s a step gives each one over a minute, and the run ends at full speed once both have healed.
    delay = tmp_path / "delay"
    delay.write_text("step:0.05")
    sid = start_training(ray_cluster, cfg, env={FILE_ENV: str(delay), ENV: str(tmp_path / "rows")})
    wait_for("training past step 40 on both replicas", lambda: _beat(cfg).get("step", 0) > 40)
    leader = heartbeat(cfg)["pid"]
    at_kill, killed_at = heartbeat(cfg)["step"], time.time()
    delay.write_text("step:0.5")
    kill(leader, signal.SIGKILL)
    _healed(cfg, 1)
    delay.write_text("step:0.05")
    healed_at = _beat(cfg)["step"]  # the SIGTERM right after: the most steps left for its replacement
    wait_for("training on after the heal", lambda: _beat(cfg)["step"] > healed_at + 5)
    sigtermed, termed_at = heartbeat(cfg)["pid"], time.time()
    delay.write_text("step:0.5")
    kill(sigtermed, signal.SIGTERM)
    _healed(cfg, 2)
    healed = heartbeat(cfg)  # the group's own count: the next group (after the third fault) counts its own
    # Then the whole job stopped (every replica SIGTERMed at once, as a cluster's drain does): no peer to heal from,
    # so the leader saves the step all of them left at, and the next group resumes from it -- nothing lost.
    delay.write_text("step:0.2")
    healed_at = _beat(cfg)["step"]
    wait_for("training on after the second heal", lambda: _beat(cfg)["step"] > healed_at + 5)
    all_termed_at, at_all_term = time.time(), heartbeat(cfg)["step"]
    for pid in train_worker_pids(CHAOS_PORT):
        kill(pid, signal.SIGTERM)

    def restarted() -> dict | None:
        beat = _beat(cfg)
        return beat if (beat.get("first_step_at") or 0) > all_termed_at else None

    resumed = wait_for("the group restarted from the leader's checkpoint", restarted, timeout_s=300)
    delay.write_text("")

    assert wait_job(ray_cluster, sid) == "SUCCEEDED", job_logs(ray_cluster, sid)[-5000:]
    logs = job_logs(ray_cluster, sid)
    (tmp_path / "job.log").write_text(logs)
    assert healed["heals"] == 2 and healed["last_heal"]["lost_steps"] == 0, healed
    assert not heartbeat(cfg)["healing"]
    assert re.search(r"Replacing failing replica groups", logs), logs[-5000:]
    starts = [int(m) for m in re.findall(r"rank 0: resumed from \S+checkpoint-step-(\d{8})", logs)]
    assert starts == [resumed["started_step"]] and resumed["started_step"] >= at_all_term, (starts, at_all_term)
    assert ckpt.read_verified(f"{Layout(cfg.storage).checkpoints_dir(cfg.name)}/{ckpt.checkpoint_name(starts[0])}")
    lost = max(0, at_all_term - resumed["started_step"])
    REPORT.append(
        {
            "scenario": "live: SIGTERM every worker",
            "detected_by": "the workers (leader checkpoints)",
            "detection_s": None,
            "recovery_s": resumed["first_step_at"] - all_termed_at,
            "lost_steps": lost,
        }
    )
    assert re.search(r"replica \d: SIGTERM: leaving after step \d+ \(committed\); replaced live", logs), logs[-5000:]
    assert len(re.findall(r"healed from a live peer at step \d+", logs)) >= 2, logs[-5000:]
    first = _degraded_at(logs, killed_at)
    REPORT.append({"scenario": "live: kill -9 a worker", "detected_by": "torchft quorum (in job)",
                   "detection_s": None, "recovery_s": first - killed_at, "lost_steps": 0})  # fmt: skip
    REPORT.append({"scenario": "live: SIGTERM a worker", "detected_by": "the worker (leaves at a step)",
                   "detection_s": None, "recovery_s": _degraded_at(logs, termed_at) - termed_at,
                   "lost_steps": 0})  # fmt: skip
    # The survivor never waited for the replacement: it trained steps alone before the newcomer healed from it.
    alone = [int(m) for m in re.findall(r"step (\d+) trained by replicas \[\d\] of 2", logs) if int(m) > at_kill]
    healed = [int(m) for m in re.findall(r"healed from a live peer at step (\d+)", logs)]
    assert alone and any(h > alone[0] for h in healed), (at_kill, alone, healed)
    # Every row of the uninterrupted run, each once; the uninterrupted run's weights and logged values, bit for bit.
    want, _ = trained_rows(uninterrupted[1])
    got, _ = trained_rows(tmp_path / "rows")
    assert got == want
    assert final_weights_hash(cfg) == baseline
    check_trackers(cfg.storage, cfg.name, cfg.series_name, baseline_metrics(uninterrupted))


def _healed(cfg, heals: int) -> None:
    wait_for(f"replacement {heals} healed", lambda: _beat(cfg).get("heals", 0) >= heals
             and _beat(cfg)["participants"] == 2, timeout_s=300)  # fmt: skip


def _beat(cfg) -> dict:
    try:
        return heartbeat(cfg)
    except Exception:
        return {}
