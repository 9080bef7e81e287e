"""The faults users meet first, outside anything unbroken scripts: a cluster gone for good, a head someone else
started on the run's ports, a full disk under the lease (two projects naming their runs alike on one head:
tests/integration/test_two_runs.py). Each on the chaos suite's real head with real jobs: nothing is torn down,
doubled, locked or abandoned, and what cannot be done ends in a clear refusal or a give-up that says why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from control import registry
from control.backends.base import ClusterHandle, jobs_client
from control.describe import describe
from ray_jobs.storage import Layout
from tests.chaos.harness import (
    REPORT,
    WatchdogLoop,
    chaos_config,
    check_one_attempt,
    heartbeat_step,
    start_run,
    until_finished,
    wait_for,
    wait_job,
)
from tests.conftest import ROOT
from tests.faults import FaultProxy, small_disk

pytestmark = pytest.mark.chaos

SLOW_STEPS = {"UNBROKEN_INJECT_DELAY": "step:0.12"}  # a fault lands mid-training (bit-identical: a sleep)
QUICK = {"fault_tolerance.max_failures": 0, "fault_tolerance.restart_backoff_s": 1, "fault_tolerance.confirm_s": 3}


@pytest.mark.full(shard=1)  # a head lost again, for good (its give-up: tests/unit/test_decide.py)
def test_an_address_cluster_gone_for_good_ends_in_a_give_up_with_its_reason_and_an_event(
    ray_cluster, tmp_path, asserting_events
) -> None:
    """A run on someone else's cluster (backend ``address``, reached through a proxy) whose cluster vanishes for good
    -- its job gone with it, its address never answering again. The watchdog cannot verify the old job stopped, so it
    submits nothing: each restart it tries is a failed restart, counted and backed off, and the run ends ``failed``
    with the reason and an ``unbroken.run.gave-up`` event -- not an incident left open on every pass forever."""
    from prefect.events.worker import EventsWorker

    from flows.watchdog import watchdog

    host, port = ray_cluster.address.removeprefix("http://").split(":")
    with FaultProxy(host, int(port)) as proxy:
        cfg = chaos_config(tmp_path / "storage", "gone-for-good", **QUICK | {"cluster.address": proxy.url,
                           "cluster.backend": "address", "fault_tolerance.max_restarts": 1})  # fmt: skip
        sid = start_run(ClusterHandle(proxy.url, proxy.url, False, sys.executable), cfg, env=SLOW_STEPS)
        wait_for("step 10", lambda: heartbeat_step(cfg) > 10, timeout_s=180)
        jobs_client(ray_cluster.address).stop_job(sid)  # the cluster takes its job with it ...
        wait_job(ray_cluster, sid)
        proxy.set("reset")  # ... and is never heard of again
        gone_at, passes = time.time(), []
        while (reg := registry.load(cfg.storage, cfg.name)).state != "failed" and time.time() - gone_at < 180:
            passes += [o["action"] for o in watchdog(cfg.storage) if o["run"] == cfg.name]
            time.sleep(0.5)
    status = describe(cfg.storage, cfg.name)
    assert reg.state == "failed", f"{status}\n{passes}"
    assert "restart-failed" in passes and passes[-1] == "gave-up" and "restarted" not in passes, passes
    assert len(reg.attempts) == 1, "nothing was submitted onto a cluster whose old job could not be known stopped"
    assert reg.reason.startswith("restart budget exhausted: 1 of fault_tolerance.max_restarts=1"), status
    assert "could not complete, the last: StopUnverified" in reg.reason and proxy.url in reg.reason, status
    EventsWorker.drain_all()
    events = [e for c in asserting_events.all for e in c.events if e.event == "unbroken.run.gave-up"]
    assert [e.resource.id for e in events] == [f"unbroken.run.{cfg.name}"], events
    assert "restart budget exhausted" in events[0].payload["detail"]
    REPORT.append({"scenario": "address cluster gone for good", "detected_by": "watchdog (gave up, event)",
                   "detection_s": reg.incidents[-1].detected_at - gone_at, "recovery_s": 0.0,
                   "lost_steps": 0})  # fmt: skip


def test_a_head_started_with_another_environment_on_the_runs_ports_is_refused_in_one_line(ray_cluster, tmp_path):
    """The chaos suite's head answers on the run's ports, but it was started without the variables this run passes
    to its jobs (``cluster.env_passthrough``: a job there would lack them, as an S3 run's lacked its credentials on a
    head an earlier checkout left up). ``unbroken run`` refuses in one line naming the ports, before Prefect, staging
    or a submission: the head's job list is as it was."""
    before = {j.submission_id for j in jobs_client(ray_cluster.address).list_jobs()}
    port = ray_cluster.address.rsplit(":", 1)[1]
    args = ["--set", f"storage={tmp_path / 'storage'}", "--set", f"cluster.dashboard_port={port}", "--set",
            "cluster.head_port=6399", "--set", "cluster.env_passthrough=[UNBROKEN_TEAM_TOKEN_FILE]"]  # fmt: skip
    env = dict(os.environ, UNBROKEN_TEAM_TOKEN_FILE="/run/secrets/team-token")
    out = subprocess.run([sys.executable, "-m", "unbroken", "run", str(ROOT / "configs" / "demo.yaml"), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and out.stdout == "", out.stdout + out.stderr
    assert lines[0].startswith(f"error: cluster.dashboard_port={port}, cluster.head_port=6399: the Ray head on these "
                               "ports was started with another cluster.env_passthrough")  # fmt: skip
    assert {j.submission_id for j in jobs_client(ray_cluster.address).list_jobs()} == before, "nothing submitted"
    assert not (tmp_path / "storage").exists(), "nothing staged or recorded"


def test_a_full_lease_folder_then_freed_lets_the_run_finish_as_if_nothing_happened(
    ray_cluster, baseline, tmp_path
) -> None:
    """The run's lease folder fills up (a tmpfs to the last byte) while it trains: the watchdog's passes say
    ``storage-full`` and leave no empty lease generation behind (one would be read as "being acquired" forever: the
    run locked even after the disk was freed). Freed, the passes take the lease again and the run ends succeeded --
    one attempt, bit-identical."""
    cfg = chaos_config(tmp_path / "storage", "full-leases", **QUICK)
    start_run(ray_cluster, cfg)
    leases_dir = Path(Layout(cfg.storage).lease_dir(cfg.name))
    with small_disk(leases_dir) as (fill, free), WatchdogLoop(cfg) as dog:
        wait_for("step 20", lambda: heartbeat_step(cfg) > 20, timeout_s=180)
        fill()
        wait_for("a pass that found the lease folder full", lambda: "storage-full" in dog.actions(), timeout_s=60)
        torn = [p.name for p in leases_dir.glob("lease-*") if not p.read_bytes().strip()]
        assert torn == [], "no generation left behind empty or torn"
        free()
        reg = until_finished(cfg)
        after = dog.actions()[dog.actions().index("storage-full") :]
    check_one_attempt(reg, cfg, baseline, ray_cluster)
    assert "succeeded" in after, after
    assert not [a for a in dog.actions() if a.startswith("error")], dog.actions()
