"""Using an existing cluster (cluster.address): the flow uses it, never stops it, and fails clearly when it can't."""

from __future__ import annotations

from pathlib import Path

import pytest

from control.backends.base import reachable
from control.backends.local import start_local_head, stop_local_head
from ray_jobs.config import load_config
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_registry, run_cli

pytestmark = pytest.mark.integration
DEMO = str(ROOT / "configs" / "demo.yaml")
PORT = 8275  # not the default, so this "existing" cluster is clearly not one unbroken would start


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> str:
    storage = tmp_path_factory.mktemp("existing")
    cfg = load_config(DEMO, [f"storage={storage}", f"cluster.dashboard_port={PORT}", "cluster.head_port=6389"])
    handle = start_local_head(cfg)
    assert handle.started_here, "another Ray cluster is already running on this machine"
    yield handle.address
    stop_local_head(handle)


def sets(storage: Path, **extra: object) -> list[str]:
    return [arg for kv in tiny_overrides(storage, **extra) for arg in ("--set", kv)]


def test_flow_uses_an_existing_cluster_and_leaves_it_running(cluster: str, tmp_path: Path) -> None:
    """Staging runs there too (``data.stage_on: cluster``), then the training on what it staged."""
    storage = tmp_path / "storage"
    r = run_cli("run", DEMO, *sets(storage, name="ext", **{"cluster.address": cluster, "data.stage_on": "cluster"}))
    assert r.returncode == 0, r.explain()
    assert f"staging on the cluster at {cluster}" in r.stderr + r.stdout, r.explain()
    assert r.last_line == f"final model: {storage / 'runs' / 'ext' / 'final'}"
    assert reachable(cluster) is None, "a cluster the flow did not start must be left running"
    assert read_registry(storage, "ext")["cluster"] == {"address": cluster, "backend": "address", "mode": "existing",
                                                        "spec": {"address": cluster}, "started_here": False}  # fmt: skip


def test_a_job_the_cluster_cannot_fit_fails_with_a_clear_reason(cluster: str, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    r = run_cli("run", DEMO, *sets(storage, name="toobig", **{"cluster.address": cluster, "cluster.num_workers": 64}))
    assert r.returncode == 2, r.explain()  # a user's mistake, said once (unbroken/errors.py)
    assert r.stderr.count("error: ") == 1 and "Traceback" not in r.stderr, r.explain()
    assert "cluster.num_workers=64" in r.stderr and "CPUs; the cluster has" in r.stderr, r.explain()
    # Refused before its attempt was recorded (check-cluster-fits): nothing is left for a watchdog.
    assert not (storage / "runs" / "toobig" / "run.json").exists()
    assert not (storage / "runs" / "toobig" / "final").exists()


def test_unreachable_cluster_address_is_a_clear_error(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    r = run_cli("run", DEMO, *sets(storage, name="nowhere", **{"cluster.address": "http://127.0.0.1:9"}))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.explain()  # refused before Prefect
    assert "cluster.address http://127.0.0.1:9 is not reachable" in r.stderr, r.explain()
