"""The Kubernetes objects the ``kuberay`` backend (control/backends/kuberay.py) creates, built from
``cluster.kuberay``: the RayCluster -- the image, a head with no CPUs for training, one worker pod per training worker
(``nvidia.com/gpu`` per pod, node selector, tolerations), the checkpoint storage wired into every pod (S3 credentials
from a Secret by name, or a ReadWriteMany PVC mounted at the storage path), Ray token auth (``authOptions``, the token
in a Secret), and labels naming the run -- and the token's Secret. Each a ``Manifest`` (control/backends/kubeobjects.py)
the client validates on the way out. Pure: no API call."""

from __future__ import annotations

import base64
import re

from control.backends.kubeobjects import Manifest
from ray_jobs.config import Config

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
RAY_VERSION = "2.60.0"
MANAGED_BY = {"app.kubernetes.io/managed-by": "unbroken"}
RUN_LABEL, SERIES_LABEL, STORAGE_ANNOTATION = "unbroken.io/run", "unbroken.io/series", "unbroken.io/storage"
STORAGE_LABEL = "unbroken.io/storage-tag"  # which storage's run made it (its tag), for the janitor and for kubectl
DASHBOARD_PORT = 8265
STORAGE_VOLUME = "unbroken-storage"


def dns_name(text: str, limit: int = 50) -> str:
    """A Kubernetes object name (RFC 1035 label: lowercase alphanumerics and '-', starting with a letter); a label
    value obeys the same here."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = name if name[:1].isalpha() else f"u-{name}"
    return name[:limit].rstrip("-")


def cluster_name(cfg: Config) -> str:
    """One RayCluster per series unless named: the series' runs take turns on it (a name is a stable handle the
    watchdog finds again)."""
    return cfg.cluster.kuberay.name or dns_name(f"unbroken-{cfg.series_name}")


def token_secret_name(cfg: Config) -> str:
    return cfg.cluster.kuberay.auth_secret or f"{cluster_name(cfg)}-ray-token"


def _container(cfg: Config, name: str, cpus: str, memory: str, gpus: int) -> Manifest:
    k = cfg.cluster.kuberay
    limits: dict[str, str] = {"cpu": cpus, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    c: Manifest = {
        "name": name,
        "image": k.image,
        "resources": {"requests": dict(limits), "limits": limits},
        "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}],
    }
    if k.s3_secret:
        c["envFrom"] = [{"secretRef": {"name": k.s3_secret}}]
    if k.storage_pvc:
        c["volumeMounts"] = [{"name": STORAGE_VOLUME, "mountPath": cfg.storage}]
    if name == "ray-head":
        c["ports"] = [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
        ]
    return c


def _pod(cfg: Config, run: str, container: Manifest, worker: bool) -> Manifest:
    k = cfg.cluster.kuberay
    spec: Manifest = {"containers": [container]}
    if k.storage_pvc:
        spec["volumes"] = [{"name": STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": k.storage_pvc}}]
    if worker and k.node_selector:
        spec["nodeSelector"] = dict(k.node_selector)
    if worker and k.tolerations:
        spec["tolerations"] = [dict(t) for t in k.tolerations]
    return {"metadata": {"labels": labels(cfg, run)}, "spec": spec}


def labels(cfg: Config, run: str) -> dict[str, str]:
    named = {RUN_LABEL: dns_name(run, 63), SERIES_LABEL: dns_name(cfg.series_name, 63)}
    return {**MANAGED_BY, **named, STORAGE_LABEL: storage_tag(cfg.storage)}


def storage_tag(storage: str) -> str:
    """The storage's short identity (the run records' own: control/records/run.py), a valid label value."""
    from control.records.run import storage_tag as tag

    return tag(storage)


def raycluster_manifest(cfg: Config, run: str) -> Manifest:
    """The RayCluster unbroken creates for ``run`` (ray.io/v1, fields of the KubeRay CRD API reference)."""
    k = cfg.cluster.kuberay
    head = _container(cfg, "ray-head", k.head_cpus, k.head_memory, 0)
    worker = _container(cfg, "ray-worker", k.worker_cpus, k.worker_memory, k.gpus_per_worker)
    # GCS fault tolerance (cluster.gcs_ft): KubeRay gives the head RAY_REDIS_ADDRESS and the workers a long GCS
    # reconnect timeout, so a head pod that dies and comes back leaves the workers' training running
    ft = {"gcsFaultToleranceOptions": {"redisAddress": cfg.cluster.gcs_ft}} if cfg.cluster.gcs_ft else {}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RayCluster",
        "metadata": {
            "name": cluster_name(cfg),
            "namespace": k.namespace,
            "labels": labels(cfg, run),
            "annotations": {STORAGE_ANNOTATION: cfg.storage, RUN_LABEL: run},
        },
        "spec": {
            "rayVersion": RAY_VERSION,
            "authOptions": {"mode": "token", "secretName": token_secret_name(cfg)},
            **ft,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                # no training on the head: it runs Ray's control plane and the job drivers
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                "template": _pod(cfg, run, head, worker=False),
            },
            "workerGroupSpecs": [
                {
                    "groupName": "workers",
                    "replicas": cfg.workers[1],  # one pod per training worker (live recovery's standbys too)
                    "minReplicas": cfg.workers[0],
                    "maxReplicas": cfg.workers[1],
                    "rayStartParams": {},
                    "template": _pod(cfg, run, worker, worker=True),
                }
            ],
        },
    }


def token_secret_manifest(cfg: Config, run: str, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": token_secret_name(cfg),
            "namespace": cfg.cluster.kuberay.namespace,
            "labels": labels(cfg, run),
        },
        "data": {"auth_token": base64.b64encode(token.encode()).decode()},
    }
