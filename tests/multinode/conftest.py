"""A real multi-host Ray cluster on this machine for the whole multinode suite (tests/hosts.py): a head host with no
CPUs of its own, and three worker hosts of one CPU each -- two for the training workers, one spare (N+1). (The head
loss under GCS fault tolerance has a cluster of its own: test_head_loss.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from control.backends.base import ClusterHandle
from tests.hosts import Hosts, can_make_hosts

GCS_PORT, DASHBOARD_PORT = 6411, 8411


@pytest.fixture(scope="package")
def hosts(tmp_path_factory) -> Hosts:
    why = can_make_hosts()
    assert why is None, f"the multinode tests cannot build hosts here: {why}"
    hs = Hosts("ubmn", 4, 77, tmp_path_factory.mktemp("hosts"), hidden=tmp_path_factory.mktemp("flow-host-only")).up()
    try:
        yield hs.start_cluster(GCS_PORT, DASHBOARD_PORT)
    finally:
        hs.down()


@pytest.fixture(scope="package")
def cluster(hosts: Hosts) -> ClusterHandle:
    address = f"http://{hosts.head.addr}:{DASHBOARD_PORT}"
    return ClusterHandle(address, address, False, sys.executable)


@pytest.fixture(scope="package")
def baseline_run(uninterrupted) -> tuple[str, Path]:
    """The chaos config trained without interruption on two workers (the session's one run, tests/conftest.py): its
    final-weights hash, and the folder of its row trace (which rows every step trained on)."""
    return uninterrupted


@pytest.fixture(scope="package")
def baseline(baseline_run) -> str:
    return baseline_run[0]
