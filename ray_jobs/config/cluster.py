"""``cluster``: how a run gets its Ray cluster (the backend and its settings) and how many workers it trains with."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from ray_jobs.config.base import Section


class WorkerRange(Section):
    min: int = Field(ge=1)
    """Fewest workers the run trains with (Ray Train waits for at least this many)."""
    max: int = Field(ge=1)
    """Most workers; also how the data is laid out (see ``num_workers``)."""


class RayUpConfig(Section):
    config: str = ""
    """The cluster YAML the Ray cluster launcher takes (``ray up``: provider, node types, setup and start commands),
    a path on the machine that runs the flow. Its ``cluster_name`` names the cluster."""
    dashboard_address: str = ""
    """The Jobs API as the flow reaches it (an SSH tunnel or port-forward: ``http://127.0.0.1:8265``; a load
    balancer); empty = ``http://<head IP>:8265``, the head's address as the launcher reports it."""
    up_timeout_s: float = Field(900.0, gt=0)
    """How long ``up`` waits for the head's Jobs API to answer once the launcher is done."""

    @field_validator("dashboard_address")
    @classmethod
    def _http(cls, v: str) -> str:
        return _jobs_api_url(v)


class KubeRayConfig(Section):
    image: str = ""
    """The container image of every Ray pod (Ray 2.60 and this project's dependencies installed, like
    ``rayproject/ray:2.60.0-py311-gpu`` plus ``pip install unbroken``)."""
    namespace: str = "default"
    """The Kubernetes namespace the RayCluster (and its pods) is created in."""
    name: str = ""
    """The RayCluster's name; empty = ``unbroken-<series>`` (one per series: its runs take turns on it)."""
    context: str = ""
    """The kubeconfig context to use; empty = the current one (or the in-cluster service account)."""
    head_cpus: str = "2"
    """CPU request and limit of the head pod (Kubernetes quantity: ``2``, ``500m``); no training runs there."""
    head_memory: str = "8Gi"
    """Memory request and limit of the head pod (Kubernetes quantity: ``8Gi``)."""
    worker_cpus: str = "8"
    """CPU request and limit of each worker pod (one pod per training worker)."""
    worker_memory: str = "32Gi"
    """Memory request and limit of each worker pod (Kubernetes quantity: ``32Gi``); a worker holds the model, its
    optimizer state and the node cache's reads."""
    gpus_per_worker: int = Field(0, ge=0)
    """``nvidia.com/gpu`` per worker pod; ``cluster.use_gpu`` needs at least 1."""
    node_selector: dict[str, str] = {}
    """Worker pods' ``nodeSelector`` (``{cloud.google.com/gke-accelerator: nvidia-l4}``)."""
    tolerations: list[dict[str, Any]] = []
    """Worker pods' tolerations (``[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]``)."""
    s3_secret: str = ""
    """A Secret whose keys (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ...) become every Ray container's
    environment: how pods reach ``s3://`` storage. Empty: the pods' own identity (IRSA, workload identity)."""
    storage_pvc: str = ""
    """A ReadWriteMany PersistentVolumeClaim mounted on every pod at ``storage`` (a local-path storage must be one:
    a pod's own disk does not outlive it)."""
    auth_secret: str = ""
    """A Secret holding the Ray auth token under ``auth_token`` (``authOptions.secretName``); empty = KubeRay
    generates one per cluster, and the flow reads it from the Secret named like the cluster."""
    dashboard_address: str = ""
    """The Jobs API as the flow reaches it (a port-forward, an ingress); empty = the head Service's in-cluster DNS
    name, ``http://<name>-head-svc.<namespace>.svc.cluster.local:8265`` (a flow running in the cluster)."""
    ready_timeout_s: float = Field(600.0, gt=0)
    """How long ``up`` waits for the RayCluster to be ready (pods scheduled, images pulled, Ray started)."""

    @field_validator("dashboard_address")
    @classmethod
    def _http(cls, v: str) -> str:
        return _jobs_api_url(v)


def _jobs_api_url(v: str) -> str:
    v = v.strip()
    if v and not re.match(r"^https?://[^/\s]+", v):
        raise ValueError(f"must be the Jobs API URL, like http://head-node:8265 (got {v!r})")
    return v.rstrip("/")


# The cluster backends, by name: the one place a backend is registered. Each is control/backends/<name>.py (a "-" in
# the name is a "_" there) and its ``BACKEND`` class; the control plane finds it from this list
# (control/backends/__init__.py), which the config holds because the config cannot import the control plane.
BackendName = Literal["local", "address", "ray-up", "kuberay"]


class ClusterConfig(Section):
    backend: BackendName | None = None
    """How the run gets its Ray cluster: ``local`` (a head on this machine), ``address`` (an existing cluster at
    ``cluster.address``), ``ray-up`` (the Ray cluster launcher, ``cluster.ray_up``), ``kuberay`` (a RayCluster on
    Kubernetes, ``cluster.kuberay``). Unset: ``address`` when an address is given, else ``local``."""
    address: str = ""
    """Ray Jobs API address of an existing cluster (``http://head:8265``); empty = start a local head."""
    python: str = "python"
    """The interpreter the jobs run with on a cluster unbroken did not start itself (``address``, ``ray-up``,
    ``kuberay``): the one with this project's dependencies, like ``~/unbroken-venv/bin/python`` (a login shell on a
    node may put another ``python`` first). A local head uses the flow's own interpreter."""
    ray_up: RayUpConfig = RayUpConfig()
    """The Ray cluster launcher's settings (``cluster.backend: ray-up``)."""
    kuberay: KubeRayConfig = KubeRayConfig()
    """The RayCluster on Kubernetes (``cluster.backend: kuberay``)."""
    num_workers: int | WorkerRange = 2
    """Ray Train workers (ranks): a number, or ``{min, max}`` for an elastic run (Ray Train restarts with as many as
    the cluster has room for after losing a node, and grows back when nodes return). The data is always laid out
    for ``max`` workers and the global batch (``max`` x ``train.micro_batch_size`` x ``train.grad_accum_steps``) is
    kept at every world size, gradient accumulation adjusted: every training row of an epoch is used exactly once
    whatever the world size did."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long a run waits for the cluster to have room for ``num_workers`` (its ``min``) before failing, before
    anything is submitted (nodes may still be joining: an autoscaler, a host restarting)."""
    resize_check_s: float = Field(60.0, gt=0)
    """Elastic runs: how often Ray Train checks whether more workers fit and, if so, restarts the group bigger
    (``ScalingConfig.elastic_resize_monitor_interval_s``)."""
    use_gpu: bool = False
    """One GPU per worker, NCCL backend; false = CPU workers with gloo."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved per worker."""
    head_port: int = Field(6379, ge=1, le=65535)
    """GCS port of a local head started by unbroken."""
    dashboard_port: int = Field(8265, ge=1, le=65535)
    """Dashboard / Jobs API port of a local head started by unbroken (bound to 127.0.0.1)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus endpoint of a local head started by unbroken (``ray start --metrics-export-port``, bound to
    127.0.0.1): Ray's metrics and the run's ``ray_unbroken_*`` gauges at ``http://127.0.0.1:<port>/metrics``.
    0 = a free port picked when the head starts (logged with the dashboard's address, and listed in Ray's
    ``prom_metrics_service_discovery.json`` under the head's temp dir); a fixed one for a static scrape config."""
    keep_running: bool = False
    """Leave a local head that unbroken started running after the flow ends."""
    gcs_ft: str = ""
    """The Redis that keeps the head's GCS state (``redis://host:port``, ``rediss://`` for TLS, or ``host:port``):
    Ray's GCS fault tolerance. With it the head may die and come back at its address while training goes on on the
    worker nodes -- the run host (``fault_tolerance.run_host``, which it needs), Ray Train's controller and torchft's
    lighthouse are placed off the head, and a driver re-attaches once the head is back. ``ray-up``: unbroken starts
    the head with ``RAY_REDIS_ADDRESS`` and the workers with a 600 s GCS reconnect timeout; ``kuberay``: the
    RayCluster's ``gcsFaultToleranceOptions``; ``address``: says the existing cluster's head runs so (started with
    ``RAY_REDIS_ADDRESS``; give its workers ``RAY_gcs_rpc_server_reconnect_timeout_s`` longer than a head restart).
    Not for ``local``: a local head's host is the whole cluster. Empty: a lost head restarts the run."""
    env_passthrough: list[str] = [
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
        "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    ]  # fmt: skip
    """Variables of the flow's environment a local head (and so every job on it) gets, besides what a process
    needs to run (PATH, HOME, locale, ``RAY_*``). Default: the S3 storage credentials. Add ``HF_TOKEN`` here if
    jobs load gated hub models; ``PREFECT_API_KEY`` and the like never reach jobs unless listed."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        """One clear message whatever is wrong (not one per shape the union allows)."""
        if isinstance(v, WorkerRange):
            v = v.model_dump()
        if isinstance(v, bool) or not isinstance(v, int | dict):
            raise ValueError(f"must be a number of workers or {{min, max}} (got {v!r})")
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be at least 1 (got {v})")
        if isinstance(v, dict):
            if set(v) != {"min", "max"} or not all(isinstance(x, int) and not isinstance(x, bool) for x in v.values()):
                raise ValueError(f"an elastic size is {{min: N, max: M}} with whole numbers (got {v!r})")
            if v["min"] < 1:
                raise ValueError(f"min must be at least 1 (got {v['min']})")
            if v["min"] > v["max"]:
                raise ValueError(f"min ({v['min']}) is above max ({v['max']})")
            if v["min"] == v["max"]:
                return v["min"]  # not elastic: the plain number
        return v

    @property
    def min_workers(self) -> int:
        n = self.num_workers
        return n.min if isinstance(n, WorkerRange) else n

    @property
    def max_workers(self) -> int:
        """Also the data layout's number of ranks (virtual ranks, whatever the world size)."""
        n = self.num_workers
        return n.max if isinstance(n, WorkerRange) else n

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    @property
    def backend_name(self) -> BackendName:
        return self.backend or ("address" if self.address else "local")

    @field_validator("address")
    @classmethod
    def _http_address(cls, v: str) -> str:
        return _jobs_api_url(v)

    @field_validator("gcs_ft")
    @classmethod
    def _redis_address(cls, v: str) -> str:
        v = v.strip()
        if v and not re.fullmatch(r"(rediss?://)?[^\s:/]+:\d{1,5}", v):
            raise ValueError(f"must be a Redis address, like redis://10.0.0.5:6379 or 10.0.0.5:6379 (got {v!r})")
        return v


def cluster_problems(c: ClusterConfig, storage: str) -> list[str]:
    """What about the cluster section cannot work whatever the backend, each naming its field: settings of a backend
    not in use. What only one backend knows (a ``ray up`` YAML read from disk, what KubeRay pods need) is that
    backend's own check, run where the config is loaded on the control side (control/config.py), not in the job."""
    out: list[str] = []
    name = c.backend_name
    if name != "address" and c.address:
        out.append(f"cluster.address: given, but cluster.backend is {name} (an address is for backend address)")
    if name == "local" and c.metrics_port in (c.head_port, c.dashboard_port):
        out.append(f"cluster.metrics_port: {c.metrics_port} is also the head's GCS or dashboard port")
    elif name != "local" and c.metrics_port:
        out.append(
            f"cluster.metrics_port: set, but cluster.backend is {name} (only a local head is started with "
            "it; give your cluster's `ray start` --metrics-export-port)"
        )
    if name == "local" and c.gcs_ft:
        out.append(
            "cluster.gcs_ft: not for a local head (its host is the whole cluster: nothing trains on without it); "
            "give an address, ray-up or kuberay cluster"
        )
    for section, owner in (("ray_up", "ray-up"), ("kuberay", "kuberay")):
        if name != owner and getattr(c, section) != type(getattr(c, section))():  # not its defaults
            out.append(f"cluster.{section}: set, but cluster.backend is {name} (set cluster.backend: {owner})")
    return out
