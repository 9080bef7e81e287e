"""The head lost under GCS fault tolerance: every process of the head host killed mid-run, then the head started
again at its address. A cluster of its own (a head host with no CPUs, two one-CPU worker hosts) whose head keeps its
GCS state in a Redis outside every host (Debian's redis-server); the run trains under a run host, which
``cluster.gcs_ft`` places on a worker host, and with it Ray Train's controller and torchft's lighthouse (live
recovery is on), so training goes on while the head is away. The watchdog, looking all along, sees a fresh heartbeat
and acts on nothing; once the head is back its Jobs API still says RUNNING of the job whose driver died with the old
head, but the node that driver ran on is dead: the watchdog re-attaches a driver, which relays the run's end. One
attempt, nothing restarted, no step lost, bit-identical. (Without GCS fault tolerance the head's loss restarts the
run: tests/chaos/test_watchdog_recovery.py, its lost-head fault.)

Its own cluster, not the package's: on the package's, after test_elastic (make test-full) had killed a worker host
and brought it back, the head's kill stopped the steps (not yet understood; issue 56's note)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import pytest

from control import registry
from control.backends.base import ClusterHandle, jobs_client
from control.describe import describe
from ray_jobs.faults import FILE_ENV
from tests.chaos.harness import (
    REPORT,
    WatchdogLoop,
    chaos_config,
    final_weights_hash,
    heartbeat_step,
    start_run,
    until_finished,
)
from tests.chaos.test_watchdog_recovery import run_hosts, step_after
from tests.hosts import VENV_BIN, Hosts, can_make_hosts
from tests.procs import wait_for

pytestmark = pytest.mark.multinode

GCS_PORT, DASHBOARD_PORT, REDIS_PORT = 6421, 8421, 6422


@pytest.fixture(scope="module")
def ft_hosts(tmp_path_factory) -> Iterator[Hosts]:
    """A head host (no CPUs) whose GCS keeps its state in Redis, and two one-CPU worker hosts."""
    why = can_make_hosts()
    assert why is None, f"the multinode tests cannot build hosts here: {why}"
    hs = Hosts("ubhl", 3, 76, tmp_path_factory.mktemp("ft-hosts")).up()
    try:
        yield hs.start_cluster(GCS_PORT, DASHBOARD_PORT, REDIS_PORT)
    finally:
        hs.down()


WATCHED = {
    "fault_tolerance.max_failures": 0,  # nothing absorbed in the job: whatever went wrong would reach the watchdog
    "fault_tolerance.confirm_s": 5,
    "fault_tolerance.restart_backoff_s": 1,
    "fault_tolerance.run_host": True,
    # torchft's lighthouse lives on the controller's node (the run host's): it must outlive the head too
    "fault_tolerance.live_recovery": True,
}


def test_every_process_of_the_head_host_killed_under_gcs_ft_leaves_training_running_to_a_bit_identical_end(
    ft_hosts: Hosts, baseline, tmp_path
) -> None:
    hosts = ft_hosts
    address = f"http://{hosts.hosts[0].addr}:{DASHBOARD_PORT}"
    cluster = ClusterHandle(address, address, False, sys.executable)
    # ~0.3 s a step until the head is back (240 steps outlast its restart), then full speed
    delay = tmp_path / "step-delay"
    delay.write_text("step:0.3")
    cfg = chaos_config(tmp_path / "storage", "headloss", **WATCHED, **{
        "cluster.address": cluster.address, "cluster.python": str(VENV_BIN / "python"),
        "cluster.gcs_ft": f"redis://{hosts.redis_address}"})  # fmt: skip
    head = hosts.head
    assert head is not None
    start_run(cluster, cfg, env={FILE_ENV: str(delay)})
    with WatchdogLoop(cfg, every_s=1.0) as loop, head_back(hosts):
        wait_for("training", lambda: heartbeat_step(cfg) > 10, timeout_s=300)
        at_kill, killed_at = heartbeat_step(cfg), time.time()
        hosts.kill(head)
        next_at = wait_for("a step after the kill", lambda: step_after(cfg, killed_at), timeout_s=60, every_s=0.05)
        away = len(loop.outcomes)
        wait_for("ten steps more with the head away", lambda: heartbeat_step(cfg) >= at_kill + 10, timeout_s=60)
        hosts.start_head(head, GCS_PORT, DASHBOARD_PORT)
        back_at, at_back = time.time(), heartbeat_step(cfg)
        while_away = loop.actions()[away:]
        delay.write_text("")
        wait_for("a driver re-attached", lambda: registry.load(cfg.storage, cfg.name).current.drivers, timeout_s=180)
        reg = until_finished(cfg, timeout_s=300)
    status = f"{describe(cfg.storage, cfg.name)}\n{loop.actions()}"
    assert at_back < cfg.train.max_steps, f"the head came back while the run still trained: {status}"
    # nothing acted on while the head was away (a re-attach may come as soon as its Jobs API answers again)
    assert while_away and set(while_away) <= {"ok", "observing", "reattached"}, f"{while_away}: {status}"
    assert reg.state == "succeeded" and len(reg.attempts) == 1 and reg.restarts == 0, status
    assert reg.current.submission_id.endswith("-d2"), status
    assert not [i for i in reg.incidents if i.action != "observed"], status
    assert jobs_client(cluster.address).get_job_status(reg.current.submission_id) == "SUCCEEDED", status
    wait_for("no run host left", lambda: not run_hosts(cluster.address), timeout_s=60)
    REPORT.append({"scenario": "kill every process of the head host (GCS FT, run host)", "detected_by": "none needed",
                   "detection_s": 0.0, "recovery_s": next_at - killed_at, "lost_steps": 0})  # fmt: skip
    print(f"HEADLOSS next step {next_at - killed_at:.2f}s after the kill; head back after {back_at - killed_at:.1f}s, "
          f"{at_back - at_kill} steps trained meanwhile")  # fmt: skip
    assert final_weights_hash(cfg) == baseline


@contextlib.contextmanager
def head_back(hosts: Hosts) -> Iterator[None]:
    """The next test finds the package's head up, whatever happened here."""
    try:
        yield
    finally:
        if hosts.head is not None and not hosts.head.alive:
            hosts.start_head(hosts.head, GCS_PORT, DASHBOARD_PORT)
