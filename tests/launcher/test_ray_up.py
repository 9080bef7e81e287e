"""``cluster.backend: ray-up`` for real: the Ray cluster launcher brings the shipped on-prem cluster YAML up over SSH
on namespace hosts, brings a killed worker host back on ``up``, runs a training job, and -- with the whole cluster torn
down under it -- the watchdog re-provisions it through the same backend and the run finishes bit-identical to the
uninterrupted run of the same config. Then ``down`` leaves no Ray process on any host."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from control.backends import backend_for
from control.backends.base import reachable
from control.describe import describe
from ray_jobs import checkpoint as ckpt
from ray_jobs.storage import Layout
from tasks.cluster import provision_cluster
from tests.chaos.harness import REPORT, chaos_config, final_weights_hash, heartbeat_step, start_run, until_finished
from tests.chaos.test_control_plane import WatchdogLoop
from tests.hosts import VENV_BIN
from tests.launcher.conftest import cluster_yaml
from tests.procs import wait_for

pytestmark = pytest.mark.multinode

WATCHED = {"fault_tolerance.max_failures": 0, "fault_tolerance.stall_timeout_s": 60, "fault_tolerance.confirm_s": 5,
           "fault_tolerance.restart_backoff_s": 1}  # fmt: skip


def alive(backend, handle) -> list[str]:
    h = backend.health(handle)
    return sorted(n.ip for n in h.alive) if h.nodes is not None else []


def test_ray_up_runs_a_job_brings_a_lost_host_back_and_the_watchdog_reprovisions_through_it(
    machines, uninterrupted, tmp_path
):
    config = cluster_yaml(machines, tmp_path / "onprem.yaml")
    ray_up = {"cluster.backend": "ray-up", "cluster.ray_up.config": str(config), "cluster.keep_running": False,
              "cluster.python": str(VENV_BIN / "python")}  # fmt: skip
    cfg = chaos_config(tmp_path / "watched", "rayup", **ray_up, **WATCHED)
    backend = backend_for(cfg)
    head, *workers = machines.hosts
    t0 = time.time()
    handle = provision_cluster.fn(cfg)
    up_s = time.time() - t0
    assert handle.backend == "ray-up" and handle.started_here and handle.address == f"http://{head.addr}:8265"
    wait_for("the head and three workers", lambda: len(alive(backend, handle)) == 4, timeout_s=300, every_s=2)
    # A worker's Ray node is alive before the launcher has finished with it: killed in that window, the head's
    # autoscaler (v1) counts the node's launch failed, relaunches it and never sets it up again (seen under load
    # here: stuck "uninitialized"). A host dies after its setup in this scenario, so wait for the launcher to finish.
    wait_for("the launcher done with every worker (up-to-date)", lambda: launcher_done(machines, workers),
             timeout_s=120, every_s=1)  # fmt: skip
    try:
        # A worker host dies; the machine comes back; `up` again (Ray not restarted) and the head's autoscaler
        # starts Ray on the hosts that are missing.
        victim = next(w for w in workers if w.addr in alive(backend, handle))
        machines.kill(victim)
        wait_for(f"{victim.name} counted dead", lambda: victim.addr not in alive(backend, handle), timeout_s=120)
        machines.start_sshd(victim, machines.key)
        t1 = time.time()
        again = provision_cluster.fn(cfg)
        assert not again.started_here, "the live head was updated in place, not restarted"
        wait_for(f"{victim.name} back", lambda: victim.addr in alive(backend, handle), timeout_s=300, every_s=2)
        back_s = time.time() - t1

        # A job on the launched cluster, and the whole cluster torn down under it: the watchdog's restart goes
        # through the backend, and the run ends as the session's uninterrupted run of the same config did.
        start_run(handle, cfg, env={"UNBROKEN_INJECT_DELAY": "step:0.2"})
        wait_for("a checkpoint", lambda: ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(cfg.name)),
                 timeout_s=300)  # fmt: skip
        at_fault, fault_at = heartbeat_step(cfg), time.time()
        backend.down(handle, cfg.name)
        assert reachable(handle.address) is not None, "ray down stopped the head"
        with WatchdogLoop(cfg) as loop:
            reg = until_finished(cfg, timeout_s=600)
        status = describe(cfg.storage, cfg.name)
        assert reg.state == "succeeded", f"{status}\n{loop.actions()}"
        assert [i.kind for i in reg.incidents] == ["cluster-unreachable"], status
        incident = reg.incidents[0]
        assert incident.action == "restarted" and incident.reprovisioned, status
        assert reg.cluster.backend == "ray-up" and reg.cluster.spec["cluster_name"] == "unbroken-test-onprem"
        assert final_weights_hash(cfg) == uninterrupted[0], "bit-identical to the uninterrupted run"
        REPORT.append({"scenario": "ray-up: whole cluster torn down", "detected_by": "watchdog (cluster-unreachable)",
                       "detection_s": incident.detected_at - fault_at,
                       "recovery_s": incident.first_new_step_at - fault_at,
                       "lost_steps": max(0, at_fault - (incident.resumed_step or 0))})  # fmt: skip
        print(
            f"RAYUP up {up_s:.1f}s, lost host back {back_s:.1f}s, teardown -> first new step "
            f"{incident.first_new_step_at - fault_at:.1f}s"
        )
    finally:
        backend.down(handle, "test")  # (the watchdog already took it down when the run it restarted ended)
    wait_for("no Ray daemon left on any host", lambda: not [p for h in machines.hosts for p in h.pids()
             if b"raylet" in _cmd(p) or b"gcs_server" in _cmd(p)], timeout_s=60)  # fmt: skip


def launcher_done(machines, workers) -> bool:
    """Every worker host set up by the cluster launcher, as the local provider's own state file records it
    (``ray-node-status: up-to-date``; the hosts share this machine's file system)."""
    from ray.autoscaler._private.local.config import get_state_path

    try:
        state = json.loads(Path(get_state_path("unbroken-test-onprem")).read_text())
    except (OSError, ValueError):
        return False
    return all(state.get(w.addr, {}).get("tags", {}).get("ray-node-status") == "up-to-date" for w in workers)


def _cmd(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
