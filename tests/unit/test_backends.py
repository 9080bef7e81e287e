"""Cluster backends: chosen from the config, every bad backend field named in one error before any cluster work,
the shipped ``ray up`` YAMLs valid by Ray's own schema, and the run's record saying which backend made its cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from control import registry
from control.backends import backend_for
from control.backends.localhost import host_identity
from control.config import ConfigError, load_config
from tests.conftest import ROOT

DEMO = ROOT / "configs" / "demo.yaml"
CLUSTER_YAMLS = sorted((ROOT / "configs" / "clusters").glob("*.yaml"))


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, list(overrides))
    return e.value.problems


def test_the_backend_follows_the_config() -> None:
    assert backend_for(load_config(DEMO)).name == "local"
    assert backend_for(load_config(DEMO, ["cluster.address=http://head:8265"])).name == "address"
    rayup = load_config(
        DEMO, ["cluster.backend=ray-up", f"cluster.ray_up.config={ROOT / 'configs/clusters/onprem.yaml'}"]
    )
    assert backend_for(rayup).name == "ray-up"
    assert backend_for(rayup).spec() == {"config": str(ROOT / "configs/clusters/onprem.yaml"),
                                         "cluster_name": "unbroken-onprem"}  # fmt: skip


def test_every_bad_backend_field_is_named_at_once(tmp_path: Path) -> None:
    problems = _problems("cluster.backend=ray-up", "cluster.kuberay.image=ray:2.60", "train.lr=-1")
    assert any(p.startswith("train.lr:") for p in problems), "the other sections' errors come in the same message"
    assert any(p.startswith("cluster.ray_up.config: cluster.backend ray-up needs the cluster YAML") for p in problems)
    assert any(p.startswith("cluster.kuberay: set, but cluster.backend is ray-up") for p in problems), problems

    missing = tmp_path / "nope.yaml"
    assert _problems("cluster.backend=ray-up", f"cluster.ray_up.config={missing}") == [
        f"cluster.ray_up.config: cannot read {missing}: No such file or directory"
    ]
    assert _problems("cluster.backend=address") == [
        "cluster.address: cluster.backend is address, but no address is given (http://head:8265)"
    ]
    assert _problems("cluster.backend=ray-up", "cluster.address=http://h:8265")[0].startswith(
        "cluster.address: given, but cluster.backend is ray-up"
    )


def test_a_kuberay_config_without_an_image_or_a_shared_storage_is_refused() -> None:
    problems = _problems("cluster.backend=kuberay")
    assert "cluster.kuberay.image: cluster.backend kuberay needs the Ray image of its pods" in problems
    assert any(p.startswith("cluster.kuberay.storage_pvc: storage ") for p in problems), problems
    ok = load_config(DEMO, ["cluster.backend=kuberay", "cluster.kuberay.image=rayproject/ray:2.60.0",
                            "storage=s3://bucket/unbroken"])  # fmt: skip
    assert ok.cluster.backend_name == "kuberay"


def test_gpus_asked_of_a_cluster_that_declares_none_are_refused(tmp_path: Path) -> None:
    assert _problems("cluster.backend=kuberay", "cluster.kuberay.image=ray:2.60", "storage=s3://b/u",
                     "cluster.use_gpu=true") == [
        "cluster.kuberay.gpus_per_worker: cluster.use_gpu needs at least 1 GPU per worker pod (got 0)"
    ]  # fmt: skip
    cpu_only = yaml.safe_load((ROOT / "configs/clusters/aws-gpu.yaml").read_text())
    cpu_only["available_node_types"]["gpu-worker"]["resources"] = {"CPU": 8}
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(cpu_only))
    problems = _problems("cluster.backend=ray-up", f"cluster.ray_up.config={path}", "cluster.use_gpu=true")
    assert problems == [f"cluster.use_gpu: the cluster YAML {path} gives none of its node types a GPU "
                        "(available_node_types.*.resources)"]  # fmt: skip
    gpu = ROOT / "configs/clusters/aws-gpu.yaml"
    assert load_config(DEMO, ["cluster.backend=ray-up", f"cluster.ray_up.config={gpu}", "cluster.use_gpu=true"])


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_the_shipped_cluster_yamls_pass_rays_own_schema(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(yaml.safe_load(path.read_text())))  # what `ray up` runs first; raises if bad
    assert load_config(DEMO, ["cluster.backend=ray-up", f"cluster.ray_up.config={path}"]).cluster.ray_up.config


def test_gcs_fault_tolerance_is_refused_where_it_cannot_work_and_named_in_rays_own_terms(tmp_path: Path) -> None:
    """``cluster.gcs_ft``: refused for a local head (its host is the cluster) and without a run host (the driver
    lives on the head); a ``ray up`` gets a copy of the user's YAML whose head starts with ``RAY_REDIS_ADDRESS`` and
    whose workers wait 600 s for a GCS that went away -- still a YAML Ray's own schema takes."""
    from control.backends.ray_up import launch_yaml

    assert _problems("cluster.gcs_ft=redis://10.0.0.5:6379", "fault_tolerance.run_host=true") == [
        "cluster.gcs_ft: not for a local head (its host is the whole cluster: nothing trains on without it); give an "
        "address, ray-up or kuberay cluster"
    ]
    no_host = (
        "cluster.address=http://h:8265",
        "cluster.gcs_ft=redis://10.0.0.5:6379",
        "fault_tolerance.run_host=false",
    )
    assert _problems(*no_host)[0].startswith("cluster.gcs_ft: needs fault_tolerance.run_host: true")
    assert _problems(*no_host[:2])[0].startswith("cluster.gcs_ft: needs fault_tolerance.run_host: true"), "default"
    assert _problems("cluster.address=http://h:8265", "cluster.gcs_ft=http://r:6379")[0].startswith(
        "cluster.gcs_ft: must be a Redis address"
    )
    onprem = ROOT / "configs/clusters/onprem.yaml"
    cfg = load_config(DEMO, ["cluster.backend=ray-up", f"cluster.ray_up.config={onprem}",
                             "cluster.gcs_ft=10.0.0.5:6379", "fault_tolerance.run_host=true"])  # fmt: skip
    user = yaml.safe_load(onprem.read_text())
    launched = launch_yaml(str(onprem), user, cfg.cluster.gcs_ft)
    assert launched != str(onprem) and yaml.safe_load(onprem.read_text()) == user, "the user's file untouched"
    spec = yaml.safe_load(Path(launched).read_text())
    assert all(c.startswith("export RAY_REDIS_ADDRESS=10.0.0.5:6379 RAY_external_storage_namespace=unbroken-onprem; ")
               for c in spec["head_start_ray_commands"])  # fmt: skip
    assert all(c.startswith("export RAY_gcs_rpc_server_reconnect_timeout_s=600; ")
               for c in spec["worker_start_ray_commands"])  # fmt: skip
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(spec))
    assert launch_yaml(str(onprem), user, "") == str(onprem), "without it, the user's own YAML"


def test_the_run_records_which_backend_made_its_cluster(tmp_path: Path) -> None:
    onprem = ROOT / "configs/clusters/onprem.yaml"
    cfg = load_config(DEMO, [f"storage={tmp_path}", "name=r", "cluster.backend=ray-up",
                             f"cluster.ray_up.config={onprem}"])  # fmt: skip
    spec = backend_for(cfg).spec()
    registry.begin_attempt(cfg, {"address": "http://10.0.0.10:8265", "started_here": True, "spec": spec}, "ds-1")
    recorded = registry.load(cfg.storage, "r").cluster.dump()
    assert recorded == {"address": "http://10.0.0.10:8265", "backend": "ray-up", "spec": spec, "mode": "managed",
                        "started_here": True}  # fmt: skip
    local = load_config(DEMO, [f"storage={tmp_path / 'l'}", "name=l"])
    registry.begin_attempt(local, {"address": "http://127.0.0.1:8265"}, "ds-1")
    assert registry.load(local.storage, "l").cluster.mode == "local"


def test_a_managed_cluster_is_taken_down_only_by_the_run_that_brought_it_up(monkeypatch, tmp_path: Path) -> None:
    from control import cluster
    from control.backends import ClusterHandle

    downs = []

    class Backend:
        def down(self, handle, run):
            downs.append(run)
            return "down"

    monkeypatch.setattr(cluster, "backend_for", lambda cfg: Backend())
    onprem = ROOT / "configs/clusters/onprem.yaml"
    cfg = load_config(DEMO, [f"storage={tmp_path}", "cluster.backend=ray-up", f"cluster.ray_up.config={onprem}"])
    for started_here, keep, want in ((True, False, ["r"]), (False, False, []), (True, True, [])):
        downs.clear()
        cfg.cluster.keep_running = keep
        cluster.release(cfg, ClusterHandle("http://h:8265", "http://h:8265", started_here, "python",
                                                   backend="ray-up"), run="r")  # fmt: skip
        assert downs == want, (started_here, keep)


def test_a_local_head_begun_early_is_taken_over_by_up_or_let_go_if_no_up_came(tmp_path: Path, monkeypatch) -> None:
    """``unbroken run`` begins the head while Prefect boots: the flow's ``up`` takes that start over (no second
    ``ray start``); a run that ended without needing a cluster (nothing new to train) has it released."""
    from control.backends import local, localhost
    from control.backends.base import ClusterHandle

    starts, downs = [], []

    def fake_start(cfg, run=None):
        starts.append(run)
        return ClusterHandle("http://127.0.0.1:8266", "http://127.0.0.1:8266", True, "python", local=True)

    monkeypatch.setattr(local, "start_local_head", fake_start)
    monkeypatch.setattr(local.LocalHead, "down", lambda self, handle, run=None: downs.append(run) or "stopped")
    monkeypatch.setattr(localhost, "HEADS_DIR", tmp_path)
    monkeypatch.setattr(local, "_EARLY", {})
    cfg = load_config(DEMO, [f"storage={tmp_path}", "name=r", "cluster.dashboard_port=8266"])

    taken = backend_for(cfg).begin_up("r")
    assert backend_for(cfg).begin_up("r") is None, "one early start per head"
    handle = backend_for(cfg).up("r")
    assert handle.started_here and handle.spec == {"head_port": 6379, "dashboard_port": 8266, "host": host_identity()}
    assert taken.release() is None and downs == [], "taken over: the run releases it, not the early start"
    assert starts == ["r"]

    let_go = backend_for(cfg).begin_up("r")
    assert let_go.release() == "stopped" and downs == ["r"]
    assert starts == ["r", "r"] and backend_for(cfg).begin_up("r") is not None, "released: a new start may begin"
