"""Losing worker hosts mid-run, with a spare host in the cluster: one killed outright (every process of it at once),
then -- once the killed host is back as the next spare -- another cut off the network for longer than Ray's node-death
timeout. Each time Ray counts the node dead, Ray Train restarts the worker group on the hosts left, from the newest
checkpoint; the cut-off host coming back finds itself dead and leaves, disturbing nothing; the run ends bit-identical.
One job for both faults (each with its own detection, time to the next step and steps lost in the chaos table)."""

from __future__ import annotations

import time

import pytest

import ray_jobs.checkpoint as ckpt
from control.backends import health
from control.records.run import Attempt, ClusterRecord, RunRecord
from control.watchdog.notes import note_health
from control.watchdog.observe import Observations
from ray_jobs.config import Config
from ray_jobs.faults import FILE_ENV
from ray_jobs.storage import Layout
from tests.chaos.harness import (
    REPORT,
    chaos_config,
    final_weights_hash,
    heartbeat,
    heartbeat_step,
    job_logs,
    start_training,
    wait_job,
)
from tests.hosts import Host, Hosts, wait_gone
from tests.procs import wait_for

pytestmark = pytest.mark.multinode

CUT_S = 60  # longer than Ray's node-death timeout here (~25 s: tests/hosts.HEALTH_CHECK)


def look(cfg, reg: RunRecord):
    """What the watchdog's pass judges of the cluster's health (read as it reads it)."""
    return note_health(reg, cfg, Observations(time.time(), health=health.read(reg.cluster.address)))


def spare_of(hosts: Hosts) -> Host:
    training = hosts.training_hosts()
    assert len(training) == 2 and hosts.head not in training, "one training worker on each of two worker hosts"
    (spare,) = [h for h in hosts.hosts[1:] if h not in training and h.addr in hosts.alive_nodes()]
    return spare


def restarted_after(cfg: Config, fault_at: float) -> dict:
    """The heartbeat of the worker group that started stepping after ``fault_at``."""

    def stepping() -> dict | None:
        beat = heartbeat(cfg)
        return beat if (beat.get("first_step_at") or 0) > fault_at else None

    return wait_for("the restarted group's first step", stepping, timeout_s=180)


def fault_row(scenario: str, detection_s: float, fault_at: float, at_fault: int, beat: dict) -> dict:
    row = {
        "scenario": scenario,
        "detected_by": "Ray (node death)",
        "detection_s": detection_s,
        "recovery_s": beat["first_step_at"] - fault_at,
        "lost_steps": max(0, at_fault - beat["started_step"]),
    }
    REPORT.append(row)
    print("MULTINODE", row)
    return row


def test_a_worker_host_killed_then_another_cut_off_each_restart_on_a_spare_and_end_bit_identical(
    hosts, cluster, baseline, tmp_path
) -> None:
    # ~0.3 s a step (a sleep: bit-identical) until the cut-off host is back: 240 steps outlast both faults and the
    # killed host's return between them; the rest at full speed (the job's workers read the file when it changes)
    cfg = chaos_config(tmp_path / "storage", "hostloss", **{"fault_tolerance.max_failures": 2})
    delay = tmp_path / "step-delay"
    delay.write_text("step:0.3")
    sid = start_training(cluster, cfg, env={FILE_ENV: str(delay)})
    wait_for("the first checkpoint", lambda: ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(cfg.name)))
    spare, (killed, kept) = spare_of(hosts), hosts.training_hosts()
    reg = RunRecord(
        name=cfg.name,
        cluster=ClusterRecord(address=cluster.address),
        attempts=[Attempt(attempt=1, submission_id=sid, started_at=time.time(), started_by="test")],
    )
    assert look(cfg, reg)[:2] == (True, []), "the watchdog learns the shape: 4 nodes"
    cut = None
    try:
        # 1. A host killed: every process of it at once.
        at_kill, killed_at = heartbeat_step(cfg), time.time()
        hosts.kill(killed)
        detection = wait_gone(hosts, killed)
        # What the watchdog's next passes note. The dashboard's node summary it reads follows the GCS a little behind
        # the state API that wait_gone asks (seconds on a loaded machine), and a summary not read concludes nothing:
        # a later pass notes it. (A node of the package's cluster an earlier host restart left dead is Ray's dead
        # node too, named by its id when it died before reporting an address: the victim must be among those named.)
        (note,) = wait_for("the watchdog's look to note the lost node", lambda: look(cfg, reg)[1], 60, 1.0)
        assert note.startswith("nodes-missing: 3 of 4 nodes alive (dead: ") and killed.addr in note, note
        wait_for("a training worker on the spare host", lambda: spare in hosts.training_hosts(), timeout_s=180)
        fault_row("kill a worker host (N+1)", detection, killed_at, at_kill, restarted_after(cfg, killed_at))

        # 2. The killed host back (the next spare), then the other original host cut off past the node-death timeout.
        hosts.start_worker(killed)
        cut = kept
        at_cut, cut_at = heartbeat_step(cfg), time.time()
        hosts.partition(cut)
        detection = wait_gone(hosts, cut)
        wait_for("a training worker on the returned host", lambda: killed in hosts.training_hosts(), timeout_s=180)
        beat = restarted_after(cfg, cut_at)
        time.sleep(max(0.0, cut_at + CUT_S - time.time()))
        hosts.heal(cut)
        healed_at_step = heartbeat_step(cfg)
        delay.write_text("")
        fault_row(f"cut a worker host off {CUT_S} s (N+1)", detection, cut_at, at_cut, beat)

        assert wait_job(cluster, sid) == "SUCCEEDED", job_logs(cluster, sid)[-5000:]
        assert healed_at_step < cfg.train.max_steps, "the link came back while the run still trained"
        assert cut.addr not in hosts.alive_nodes(), "the node counted dead did not come back into the run"
        assert heartbeat(cfg)["started_step"] == beat["started_step"], "its return restarted nothing"
        assert final_weights_hash(cfg) == baseline
    finally:  # the next test finds N+1 again, whatever happened here
        for h in (killed, cut):
            if h is not None and h.addr not in hosts.alive_nodes():
                hosts.heal(h)
                hosts.kill(h)
                hosts.start_worker(h)
