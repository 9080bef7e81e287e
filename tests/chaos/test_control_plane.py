"""Partial, brief failures of the control plane: a hiccup never loses, doubles or abandons a run.

Each scenario runs a real job on the chaos suite's real local cluster, watched by the real watchdog code (a loop of
``check_run`` passes in a thread, one pass a second, as ``unbroken watchdog --interval 1`` does), breaks the
control plane for a while (a fault-injecting proxy in front of the Jobs API, a SIGSTOPped dashboard, a SIGSTOPped
S3 server holding the run's storage, a long export),
and checks the run ends with exactly the attempts the scenario expects and weights bit-identical to the baseline.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from control.backends.base import ClusterHandle
from control.describe import describe
from ray_jobs.config import Config
from ray_jobs.storage import Layout
from ray_jobs.train.metrics import read_rows
from tests.chaos.harness import (
    REPORT,
    WatchdogLoop,
    chaos_config,
    check_one_attempt,
    final_weights_hash,
    heartbeat_step,
    job_logs,
    kill,
    rank0_pid,
    start_run,
    start_training,
    until_finished,
    wait_for,
    wait_job,
)
from tests.faults import FaultProxy, OtherHost, dashboard_pids, listening_pids, paused
from tests.s3 import ENV as S3_ENV
from tests.s3 import make_bucket, moto_server

pytestmark = pytest.mark.chaos

# Steps slowed down (bit-identical: a sleep changes no number) so a 20 s fault lands mid-training.
SLOW_STEPS = {"UNBROKEN_INJECT_DELAY": "step:0.12"}
CONTROL = {
    "fault_tolerance.max_failures": 0,
    "fault_tolerance.stall_timeout_s": 40,
    "fault_tolerance.confirm_s": 30,
    "fault_tolerance.restart_backoff_s": 1,
}


def training_started(cfg: Config, past_step: int = 20) -> None:
    wait_for(f"step {past_step}", lambda: heartbeat_step(cfg) > past_step, timeout_s=180)


def test_a_jobs_api_failing_for_six_confirmation_windows_and_phases_longer_than_the_stall_limit_stop_nothing(
    ray_cluster, baseline, tmp_path
) -> None:
    """The run reaches its cluster through a proxy (a port-forward, an ingress) that answers 502s for 5 s (a proxy's
    blip), then dies for 10 s (connections reset); then the dashboard behind it hangs for 15 s (SIGSTOP): 30 s of an
    API that cannot tell, six times confirm_s, while the job trains and its heartbeat stays fresh. Nothing is stopped
    or restarted -- never even a suspicion: the silence is an observed incident of its own -- one attempt,
    bit-identical. Meanwhile a watchdog on a second host (its own network and PID namespaces, the same storage)
    looks at the run every second: a local head it cannot see from there is left alone, said why. Each eval (12 s)
    and the export (25 s) outlast the stall limit (10 s): a phase of its own limit, never a stall."""
    cfg = chaos_config(tmp_path / "storage", "api-silent",
                       **CONTROL | {"fault_tolerance.confirm_s": 5, "fault_tolerance.stall_timeout_s": 10})  # fmt: skip
    host, port = ray_cluster.address.removeprefix("http://").split(":")
    with FaultProxy(host, int(port)) as forward, OtherHost(f"ubwd{os.getpid() % 10000}") as laptop:
        via_forward = ClusterHandle(forward.url, forward.url, False, sys.executable)
        slow = {"UNBROKEN_INJECT_DELAY": "step:0.15,evaluating:12,exporting:25"}  # 33 s of steps after step 20
        start_run(via_forward, cfg, env=slow)
        with WatchdogLoop(cfg) as dog:
            training_started(cfg)
            laptop.watchdog_passes(cfg.storage, cfg.name, passes=15, every_s=1.0, env=dict(os.environ))
            pids = dashboard_pids(int(port))
            assert pids, "no dashboard process found for the chaos head"
            fault_at = time.time()
            forward.set("http502")  # a blip of the proxy ...
            time.sleep(5)
            forward.set("reset")  # ... then the port-forward died
            time.sleep(10)
            with paused(pids, 15):  # the dashboard behind it hangs from the moment the port-forward is back (a
                forward.set("pass")  # look answered in between would end this silence and start a second one)
                time.sleep(15)
            reg = until_finished(cfg)
        faulted, elsewhere = forward.faulted(), laptop.outcomes()
    assert faulted, "the proxy never faulted a request: the scenario tested nothing"
    observed = check_one_attempt(reg, cfg, baseline, ray_cluster)
    assert [i.kind for i in observed] == ["api-unreachable"], describe(cfg.storage, cfg.name)
    silence = observed[0]
    assert silence.cleared_at is not None and silence.held_s >= 20, describe(cfg.storage, cfg.name)
    assert any("Jobs API silent" in getattr(o, "detail", "") for o in dog.outcomes), dog.actions()
    assert not {"restarted", "restart-failed", "observing"} & set(dog.actions()), "never even a suspicion"
    assert any("phase exporting" in getattr(o, "detail", "") for o in dog.outcomes), dog.actions()
    assert len(elsewhere) == 15 and {o["action"] for o in elsewhere} == {"elsewhere"}, elsewhere
    assert "net_ns" in elsewhere[0]["detail"] and "left to a watchdog on that host" in elsewhere[0]["detail"]
    REPORT.append({"scenario": "Jobs API failing 30 s (6x confirm)", "detected_by": "watchdog (observed, no action)",
                   "detection_s": silence.detected_at - fault_at, "recovery_s": 0.0, "lost_steps": 0})  # fmt: skip


@pytest.mark.full(shard=2)  # worker kills again, in a watchdog's attempt
def test_in_job_restarts_of_a_watchdog_attempt_resume_from_the_newest_checkpoint(
    ray_cluster, baseline, tmp_path, tmp_path_factory
) -> None:
    """Attempt 2 is what a watchdog submits: an explicit checkpoint (step 40, here the baseline run's, copied in).
    Two worker kills later in the same job resume from the newest checkpoints -- never back to step 40."""
    cfg = chaos_config(tmp_path / "storage", "double-kill",
                       **{"checkpoint.num_to_keep": 2, "fault_tolerance.max_failures": 3})  # fmt: skip
    ckpts = Path(Layout(cfg.storage).checkpoints_dir(cfg.name))
    source = next(Path(tmp_path_factory.getbasetemp()).glob("baseline*/storage/ray/baseline/checkpoint-step-00000040"))
    explicit = ckpts / source.name
    shutil.copytree(source, explicit)
    sid = start_training(ray_cluster, cfg, attempt=2, resume_from=str(explicit))
    for past in (130, 200):
        wait_for(f"step {past}", lambda p=past: heartbeat_step(cfg) > p, timeout_s=180)
        kill(rank0_pid(cfg), signal.SIGKILL)
    assert wait_job(ray_cluster, sid) == "SUCCEEDED", job_logs(ray_cluster, sid)[-5000:]
    logs = job_logs(ray_cluster, sid)
    resumed = [
        int(s) for s in re.findall(r"rank 0: resumed from \S+checkpoint-step-(\d{8})", logs)
    ]  # one line per start
    assert resumed[0] == 40 and len(resumed) >= 3 and all(s >= 120 for s in resumed[1:]), resumed
    assert "CheckpointInvalid" not in logs
    assert final_weights_hash(cfg) == baseline


def test_s3_storage_paused_for_30s_mid_run_training_goes_on_and_the_files_catch_up(ray_cluster, baseline, tmp_path):
    """Storage on moto's S3 server over HTTP; the server is SIGSTOPped for 30 s mid-training (requests hang, as
    against a throttled or stuck endpoint) -- twice ``stall_timeout_s``: the heartbeat cannot be written for longer
    than the stall limit, and the watchdog (on the same storage) cannot read it either. Training keeps stepping
    (heartbeat, metrics and checkpoint writes are off the training thread), the files catch up afterwards, nothing is
    restarted: one attempt, bit-identical weights."""
    with moto_server() as url:
        storage = f"{make_bucket('unbroken-pause')}/storage"
        cfg = chaos_config(tmp_path, "s3-pause", storage=storage, **CONTROL | {"fault_tolerance.stall_timeout_s": 15})
        pause_s = 2 * cfg.fault_tolerance.stall_timeout_s  # the storage away longer than the stall limit
        aws = {k: os.environ[k] for k in (*S3_ENV, "AWS_ENDPOINT_URL")}  # the job reaches the same endpoint
        start_run(ray_cluster, cfg, env=SLOW_STEPS | aws)
        with WatchdogLoop(cfg) as dog:
            training_started(cfg, past_step=40)
            paused_at = time.time()
            with paused(listening_pids(int(url.rsplit(":", 1)[1])), pause_s):
                time.sleep(pause_s)
            resumed_at = time.time()
            reg = until_finished(cfg)
        check_one_attempt(reg, cfg, baseline, ray_cluster)
        rows = read_rows(Layout(cfg.storage).metrics(cfg.name))
    during = [r["step"] for r in rows if paused_at + 2 < r["time"] < resumed_at - 2]
    assert len(during) >= 5, f"training logged only steps {during} while storage was away"
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows}), "every logged step once, in order"
    assert rows[-1]["step"] == cfg.train.max_steps
    assert "restarted" not in dog.actions(), dog.actions()
    REPORT.append({"scenario": "S3 storage SIGSTOP 30 s", "detected_by": "nobody (no action needed)",
                   "detection_s": None, "recovery_s": 0.0, "lost_steps": 0})  # fmt: skip
