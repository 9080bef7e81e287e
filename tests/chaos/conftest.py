"""One real local Ray head (token auth on) per chaos module; stopped at its end."""

from __future__ import annotations

import pytest

from ray_jobs.config import load_config
from tasks.cluster import ClusterHandle, start_local_head, stop_local_head
from tests.chaos.harness import DEMO


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> ClusterHandle:
    storage = tmp_path_factory.mktemp("chaos-cluster")
    cfg = load_config(DEMO, [f"storage={storage}", "cluster.dashboard_port=8285", "cluster.head_port=6399"])
    handle = start_local_head(cfg)
    assert handle.started_here, "another Ray cluster is already running on this machine"
    yield handle
    stop_local_head()
