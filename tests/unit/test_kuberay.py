"""The ``kuberay`` backend without a Kubernetes cluster (none here): the GPU recipe's RayCluster checked against the
KubeRay CRD's fields and the Kubernetes API's own pod models, and create -> wait -> delete, the clear timeout and
the janitor exercised with the real ``kubernetes`` client against a recording fake of the API (tests/kube.py)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from control import registry, watchdog
from control.backends import ClusterError, backend_for, kubemanifests, kuberay
from ray_jobs.config import load_config
from tests.conftest import ROOT
from tests.kube import FakeKube

# The fields of ray.io/v1 (KubeRay CRD API reference, v1.6.2 / v1.7.1: docs.ray.io, cluster/kubernetes/references/
# api.html): RayClusterSpec, HeadGroupSpec, WorkerGroupSpec, AuthOptions. Anything else the API server would prune
# or reject.
RAYCLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
                   "authOptions", "suspend", "managedBy", "headServiceAnnotations", "gcsFaultToleranceOptions",
                   "upgradeStrategy"}  # fmt: skip
HEAD_GROUP = {"template", "headService", "enableIngress", "resources", "labels", "rayStartParams", "serviceType"}
WORKER_GROUP = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "resources",
                "labels", "rayStartParams", "template", "scaleStrategy", "numOfHosts"}  # fmt: skip
AUTH_OPTIONS = {"mode", "secretName", "enableK8sTokenAuth"}
SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def check_model(value, type_name: str, path: str) -> None:
    """``value`` (a manifest's JSON) is a ``type_name`` of the Kubernetes API: every key a field of that model (the
    official client's ``attribute_map``), every value of its type, all the way down."""
    from kubernetes import client

    if type_name.lower().startswith("list["):  # List[V1Container]
        assert isinstance(value, list), f"{path}: a list"
        for i, v in enumerate(value):
            check_model(v, type_name[5:-1], f"{path}[{i}]")
    elif type_name.lower().startswith(("dict(", "dict[")):  # Dict[str, str]
        assert isinstance(value, dict), f"{path}: a mapping"
        for k, v in value.items():
            check_model(v, type_name[type_name.index(",") + 1 : -1].strip(), f"{path}.{k}")
    elif type_name in SCALARS:
        assert isinstance(value, SCALARS[type_name]) and not (type_name == "int" and isinstance(value, bool)), path
    else:
        model = getattr(client, type_name)
        fields = {json_name: attr for attr, json_name in model.attribute_map.items()}
        assert isinstance(value, dict), f"{path}: a {type_name}"
        for key, v in value.items():
            assert key in fields, f"{path}.{key}: not a field of {type_name}"
            check_model(v, model.openapi_types[fields[key]], f"{path}.{key}")


def check_raycluster(m: dict) -> None:
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayCluster"
    check_model(m["metadata"], "V1ObjectMeta", "metadata")
    spec = m["spec"]
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert set(spec["authOptions"]) <= AUTH_OPTIONS and spec["authOptions"]["mode"] in ("disabled", "token")
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP and head["serviceType"] in ("ClusterIP", "NodePort", "LoadBalancer")
    groups = [("headGroupSpec", head)] + [(f"workerGroupSpecs[{i}]", g) for i, g in enumerate(spec["workerGroupSpecs"])]
    for path, g in groups:
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), f"{path}.rayStartParams: strings"
        check_model(g["template"], "V1PodTemplateSpec", f"{path}.template")
    for g in spec["workerGroupSpecs"]:
        assert set(g) <= WORKER_GROUP, set(g) - WORKER_GROUP
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]


def gpu_recipe(tmp_path: Path, **extra: object):
    """configs/gpu-full-finetune.yaml on KubeRay: L4 nodes, S3 credentials from a Secret."""
    sets = {"cluster.address": "", "cluster.backend": "kuberay", "cluster.kuberay.image": "rayproject/ray:2.60.0-gpu",
            "cluster.kuberay.gpus_per_worker": 1, "cluster.kuberay.s3_secret": "aws-credentials",
            "cluster.kuberay.node_selector": "{cloud.google.com/gke-accelerator: nvidia-l4}",
            "cluster.kuberay.tolerations": "[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
            "cluster.kuberay.ready_timeout_s": 30} | extra  # fmt: skip
    return load_config(ROOT / "configs" / "gpu-full-finetune.yaml", [f"{k}={v}" for k, v in sets.items()])


@pytest.fixture
def kube(tmp_path, monkeypatch):
    fake = FakeKube(ready_after=3)
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "flow-token-0123456789")  # a token for a machine that has none yet
    monkeypatch.setattr(kuberay, "POLL_S", 0.05)
    # No pods behind the fake: the head Service's Jobs API is taken as answering once KubeRay says ready.
    monkeypatch.setattr(kuberay, "reachable", lambda address: None)
    yield fake
    fake.close()


def test_the_gpu_recipes_raycluster_has_only_kuberay_and_kubernetes_fields(tmp_path) -> None:
    cfg = gpu_recipe(tmp_path)
    m = kubemanifests.raycluster_manifest(cfg, "qwen05b-sft")
    check_raycluster(m)
    worker = m["spec"]["workerGroupSpecs"][0]
    assert worker["replicas"] == 8, "one worker pod per training worker"
    pod = worker["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "aws-credentials"}}]
    assert m["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "no training on the head"
    assert m["spec"]["authOptions"] == {"mode": "token", "secretName": "unbroken-qwen05b-sft-ray-token"}
    assert m["metadata"]["labels"]["unbroken.io/run"] == "qwen05b-sft"
    assert m["metadata"]["annotations"]["unbroken.io/storage"] == "s3://my-bucket/unbroken"


def test_a_pvc_is_mounted_at_the_storage_path_on_every_pod(tmp_path) -> None:
    cfg = gpu_recipe(tmp_path, **{"storage": "/mnt/shared/unbroken", "cluster.kuberay.storage_pvc": "ckpt-rwx",
                                  "cluster.num_workers": "{min: 1, max: 2}"})  # fmt: skip
    m = kubemanifests.raycluster_manifest(cfg, "r")
    check_raycluster(m)
    for group in (m["spec"]["headGroupSpec"], m["spec"]["workerGroupSpecs"][0]):
        pod = group["template"]["spec"]
        assert pod["volumes"] == [{"name": "unbroken-storage", "persistentVolumeClaim": {"claimName": "ckpt-rwx"}}]
        assert pod["containers"][0]["volumeMounts"] == [
            {"name": "unbroken-storage", "mountPath": "/mnt/shared/unbroken"}
        ]
    w = m["spec"]["workerGroupSpecs"][0]
    assert (w["minReplicas"], w["replicas"], w["maxReplicas"]) == (1, 2, 2), "elastic: min..max worker pods"


def test_up_creates_waits_until_ready_and_down_deletes(kube, tmp_path) -> None:
    cfg = gpu_recipe(tmp_path)
    backend = backend_for(cfg)
    handle = backend.up("qwen05b-sft")
    assert handle.started_here and handle.backend == "kuberay"
    assert handle.address == "http://unbroken-qwen05b-sft-head-svc.default.svc.cluster.local:8265"
    assert kube.verbs() == ["GET rayclusters/unbroken-qwen05b-sft", "POST secrets", "POST rayclusters",
                            "GET rayclusters/unbroken-qwen05b-sft"]  # fmt: skip
    assert kube.reads[("rayclusters", "default", "unbroken-qwen05b-sft")] == 3, "waited for KubeRay's ready"
    secret, created = kube.bodies[0], kube.bodies[1]
    # The token this process's Ray client sends (Ray loads it once per process: the fixture's, or an earlier one's).
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == kuberay._local_token()
    check_raycluster(created)

    again = backend.up("qwen05b-sft")  # the cluster is there (a lost pod is the operator's to replace): no create
    assert not again.started_here and kube.verbs()[-1] == "GET rayclusters/unbroken-qwen05b-sft"
    assert kube.verbs().count("POST rayclusters") == 1

    assert backend.down(handle, "qwen05b-sft") == "deleted RayCluster default/unbroken-qwen05b-sft"
    assert kube.verbs()[-2:] == [
        "DELETE rayclusters/unbroken-qwen05b-sft",
        "DELETE secrets/unbroken-qwen05b-sft-ray-token",
    ]
    assert kube.objects == {}


def test_a_cluster_that_never_gets_ready_fails_up_with_kuberays_reason(kube, tmp_path) -> None:
    kube.stuck = True
    cfg = gpu_recipe(tmp_path, **{"cluster.kuberay.ready_timeout_s": 0.5})
    with pytest.raises(ClusterError) as e:
        backend_for(cfg).up("qwen05b-sft")
    assert str(e.value) == ("RayCluster default/unbroken-qwen05b-sft not ready within cluster.kuberay.ready_timeout_s="
                            "0.5s: state=-, HeadPodReady: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu")  # fmt: skip


def test_the_janitor_deletes_clusters_whose_run_is_over_and_keeps_the_others(kube, tmp_path) -> None:
    storage = tmp_path / "storage"
    for run, state, kept in (("done", "succeeded", False), ("busy", "running", False), ("kept", "failed", True)):
        cfg = gpu_recipe(tmp_path, **{"storage": str(storage), "name": run, "cluster.kuberay.name": f"rc-{run}",
                                      "cluster.kuberay.storage_pvc": "rwx", "cluster.keep_running": kept})  # fmt: skip
        handle = backend_for(cfg).up(run)
        registry.begin_attempt(cfg, handle.to_dict(), "ds-1")
        registry.update(str(storage), run, state=state)
    gone = gpu_recipe(tmp_path, **{"storage": str(storage), "name": "gone", "cluster.kuberay.name": "rc-gone",
                                   "cluster.kuberay.storage_pvc": "rwx"})  # fmt: skip
    backend_for(gone).up("gone")  # a run whose record is gone (its flow died before recording the attempt)
    assert registry.load(str(storage), "gone") is None

    # another team's run in the same namespace, its storage not mounted here: no record this janitor can read, and
    # still never this janitor's to delete
    other = {"storage": "/mnt/another-team/storage", "name": "theirs", "cluster.kuberay.name": "rc-theirs"}
    theirs = gpu_recipe(tmp_path, **other, **{"cluster.kuberay.storage_pvc": "rwx"})
    backend_for(theirs).up("theirs")

    marked = kuberay.KubeRay.janitor_index(str(storage))  # the runs the janitor looks after
    assert registry.marked_runs(marked) == ["busy", "done", "kept"]
    assert sorted(watchdog.janitor(str(storage))) == ["rc-done", "rc-gone"]
    assert sorted(name for kind, _, name in kube.objects if kind == "rayclusters") == [
        "rc-busy",
        "rc-kept",
        "rc-theirs",
    ]
    assert registry.marked_runs(marked) == ["busy"], "finished runs are not read again on later passes"
    assert watchdog.janitor(str(storage)) == []


def test_gcs_fault_tolerance_is_the_rayclusters_own_option(tmp_path) -> None:
    """``cluster.gcs_ft``: KubeRay's ``gcsFaultToleranceOptions`` (it gives the head RAY_REDIS_ADDRESS and the workers
    a long GCS reconnect timeout); without it, no such field."""
    cfg = gpu_recipe(tmp_path, **{"cluster.gcs_ft": "redis://redis.ray:6379", "fault_tolerance.run_host": "true"})
    m = kubemanifests.raycluster_manifest(cfg, "r")
    check_raycluster(m)
    assert m["spec"]["gcsFaultToleranceOptions"] == {"redisAddress": "redis://redis.ray:6379"}
    assert "gcsFaultToleranceOptions" not in kubemanifests.raycluster_manifest(gpu_recipe(tmp_path), "r")["spec"]
