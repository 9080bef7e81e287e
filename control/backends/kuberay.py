"""Backend ``kuberay``: a RayCluster on Kubernetes, made and removed through the official ``kubernetes`` client
(the KubeRay operator turns it into pods). Its shape comes from ``cluster.kuberay``: the image, a head with no CPUs
for training, one worker pod per training worker (``nvidia.com/gpu`` per pod, node selector, tolerations), the
checkpoint storage wired into every pod (S3 credentials from a Secret by name, or a ReadWriteMany PVC mounted at the
storage path), Ray token auth (``authOptions``, the token in a Secret), and labels naming the run: the manifests
are built in control/backends/kubemanifests.py.

``up`` creates it when it does not exist and waits until KubeRay reports it ready (``cluster.kuberay
.ready_timeout_s``); a cluster that exists (a crashed pod is replaced by the operator itself) is waited on, not
re-created. ``down`` deletes it (and the token Secret unbroken made). :func:`janitor` deletes clusters unbroken made
whose run is finished or gone -- what a flow killed before its ``down`` left behind; the watchdog runs it each pass.

The token: unless ``auth_secret`` names one, unbroken puts this machine's own Ray token in a Secret
``<cluster>-ray-token`` and points ``authOptions.secretName`` at it, so the flow's and the watchdog's Ray client
open the cluster's Jobs API as they open any other.

Not run against a real Kubernetes API server here (none is available): the manifests are checked against the
KubeRay CRD fields and the Kubernetes pod models, and the calls against a recording fake of the API.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from control.backends.base import Backend, ClusterError, ClusterHandle, StopUnverified, reachable
from control.backends.kubemanifests import (
    DASHBOARD_PORT,
    GROUP,
    MANAGED_BY,
    PLURAL,
    RUN_LABEL,
    STORAGE_ANNOTATION,
    STORAGE_LABEL,
    VERSION,
    cluster_name,
    raycluster_manifest,
    storage_tag,
    token_secret_manifest,
    token_secret_name,
)
from control.backends.kubeobjects import ObjectMeta, RayCluster, RayClusterList, RayClusterStatus
from control.rayapi import headers
from control.records.run import ClusterSpec
from ray_jobs.config import ClusterConfig, Config
from ray_jobs.poll import poll_until
from ray_jobs.storage import Layout

if TYPE_CHECKING:  # the kubernetes client is imported when first used (heavy, and only this backend needs it)
    from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi
    from kubernetes.client.exceptions import ApiException

POLL_S = 2.0  # between two reads of the RayCluster's status while waiting for it


def _local_token() -> str:
    """This machine's Ray auth token: what its Ray client sends (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``)."""
    header = next(iter(headers().values()), "")
    token = header.split(" ", 1)[-1].strip()
    if not token:
        raise ClusterError(
            "no Ray auth token on this machine for the RayCluster to share (make one with `ray "
            "get-auth-token --generate`, or name a Secret in cluster.kuberay.auth_secret)"
        )
    return token


def ready(obj: RayCluster) -> bool:
    """KubeRay's verdict: ``status.state`` ready (all pods running), or the RayClusterProvisioned condition."""
    status: RayClusterStatus = obj.get("status") or {}
    if status.get("state") == "ready":
        return True
    return any(
        c.get("type") == "RayClusterProvisioned" and c.get("status") == "True" for c in status.get("conditions") or []
    )


def _status_line(obj: RayCluster | None) -> str:
    if obj is None:
        return "it does not exist"
    status: RayClusterStatus = obj.get("status") or {}
    bits = [f"state={status.get('state') or '-'}"]
    if status.get("reason"):
        bits.append(f"reason={status['reason']}")
    for c in status.get("conditions") or []:
        if c.get("status") != "True" and c.get("message"):
            bits.append(f"{c.get('type')}: {c['message']}")
    return ", ".join(bits)


def config_problems(c: ClusterConfig, storage: str) -> list[str]:
    """What KubeRay pods need of the config: an image, a GPU per pod if asked for, storage every pod shares."""
    out: list[str] = []
    k = c.kuberay
    if not k.image:
        out.append("cluster.kuberay.image: cluster.backend kuberay needs the Ray image of its pods")
    if c.use_gpu and k.gpus_per_worker < 1:
        out.append("cluster.kuberay.gpus_per_worker: cluster.use_gpu needs at least 1 GPU per worker pod (got 0)")
    if storage and "://" not in storage and not k.storage_pvc:
        out.append(
            f"cluster.kuberay.storage_pvc: storage {storage} is a path; on Kubernetes it must be a "
            "ReadWriteMany volume mounted on every pod (name its PVC), or use s3:// storage"
        )
    return out


class KubeRay(Backend):
    name = "kuberay"

    def __init__(self, cfg: Config, api_client: ApiClient | None = None) -> None:
        super().__init__(cfg)
        self._client = api_client

    @classmethod
    def problems(cls, cluster: ClusterConfig, storage: str) -> list[str]:
        return config_problems(cluster, storage)

    def spec(self) -> ClusterSpec:
        k = self.cfg.cluster.kuberay
        return {"namespace": k.namespace, "name": cluster_name(self.cfg), "context": k.context, "image": k.image}

    # -- the Kubernetes API ------------------------------------------------------------------------------------
    def _api(self) -> ApiClient:
        if self._client is None:
            from kubernetes import client, config

            context = self.cfg.cluster.kuberay.context or None
            conf = client.Configuration()
            try:  # KUBECONFIG read now (the client reads it once, at import)
                config.load_kube_config(os.environ.get("KUBECONFIG"), context, client_configuration=conf)
            except config.ConfigException as outside:
                try:
                    config.load_incluster_config(client_configuration=conf)
                except config.ConfigException as inside:
                    raise ClusterError(
                        f"no Kubernetes API to talk to: kubeconfig: {outside}; in-cluster: {inside}"
                    ) from inside
            self._client = client.ApiClient(conf)
        return self._client

    def _custom(self) -> CustomObjectsApi:
        from kubernetes import client

        return client.CustomObjectsApi(self._api())

    def _core(self) -> CoreV1Api:
        from kubernetes import client

        return client.CoreV1Api(self._api())

    def _get(self) -> RayCluster | None:
        from kubernetes.client.exceptions import ApiException

        k = self.cfg.cluster.kuberay
        try:
            obj = self._custom().get_namespaced_custom_object(
                GROUP, VERSION, k.namespace, PLURAL, cluster_name(self.cfg)
            )
            return cast(RayCluster, obj)  # the client annotates ``object``: it is the decoded JSON object, a dict
        except ApiException as e:
            if e.status == 404:
                return None
            raise ClusterError(f"Kubernetes API: reading RayCluster {cluster_name(self.cfg)}: {_why(e)}") from e

    def _ensure_token_secret(self, run: str) -> None:
        from kubernetes.client.exceptions import ApiException

        if self.cfg.cluster.kuberay.auth_secret:
            return  # the user's own Secret: its token must be this machine's (their setup)
        body = token_secret_manifest(self.cfg, run, _local_token())
        ns, name = self.cfg.cluster.kuberay.namespace, token_secret_name(self.cfg)
        try:
            # the client's pydantic validate_call turns the dict body into its V1Secret; the annotation names the model
            self._core().create_namespaced_secret(ns, body)  # ty: ignore[invalid-argument-type]
        except ApiException as e:
            if e.status != 409:
                raise ClusterError(f"Kubernetes API: creating Secret {name}: {_why(e)}") from e
            # ours: keep it current (a dict body, as above)
            self._core().replace_namespaced_secret(name, ns, body)  # ty: ignore[invalid-argument-type]

    # -- the interface -----------------------------------------------------------------------------------------
    def _jobs_api(self) -> str:
        k = self.cfg.cluster.kuberay
        service = f"{cluster_name(self.cfg)}-head-svc.{k.namespace}.svc.cluster.local"  # KubeRay's head Service
        return k.dashboard_address or f"http://{service}:{DASHBOARD_PORT}"

    def address(self) -> str | None:
        obj = self._get()
        if obj is None or not ready(obj):
            return None
        return self._jobs_api() if reachable(self._jobs_api()) is None else None

    def up(self, run: str | None = None) -> ClusterHandle:
        from kubernetes.client.exceptions import ApiException

        run = run or self.cfg.name
        k = self.cfg.cluster.kuberay
        created = False
        if self._get() is None:
            self._ensure_token_secret(run)
            try:
                self._custom().create_namespaced_custom_object(
                    GROUP, VERSION, k.namespace, PLURAL, raycluster_manifest(self.cfg, run)
                )
                created = True
            except ApiException as e:
                if e.status != 409:  # 409: another flow created it meanwhile; wait for it like for our own
                    raise ClusterError(
                        f"Kubernetes API: creating RayCluster {cluster_name(self.cfg)}: {_why(e)}"
                    ) from e
        seen: list[RayCluster | None] = [None]  # the last look, for the time-out's message

        def answers() -> bool:
            seen[0] = obj = self._get()
            return obj is not None and ready(obj) and reachable(self._jobs_api()) is None

        if poll_until(answers, k.ready_timeout_s, every_s=POLL_S):
            return self._handle(self._jobs_api(), created)
        obj = seen[0]
        where = "" if obj is None or not ready(obj) else f"; its Jobs API {reachable(self._jobs_api())}"
        raise ClusterError(
            f"RayCluster {k.namespace}/{cluster_name(self.cfg)} not ready within "
            f"cluster.kuberay.ready_timeout_s={k.ready_timeout_s:g}s: {_status_line(obj)}"
            f"{where}"
        )

    def stop_unreachable(self, handle: ClusterHandle, run: str, submission_id: str) -> str:
        """A RayCluster unbroken made whose Jobs API does not answer and whose job's heartbeat went quiet: deleting
        it ends its job for certain -- but only when the Kubernetes API agrees it is not healthy (gone, or not
        ready). One the operator reports ready may only be out of this watchdog's reach (a port-forward, an
        ingress): StopUnverified, nothing deleted."""
        try:
            obj = self._get()
        except ClusterError as e:  # the Kubernetes API cannot say either
            raise StopUnverified(str(e)) from e
        if obj is not None and ready(obj):
            raise StopUnverified(
                f"RayCluster {self.cfg.cluster.kuberay.namespace}/{cluster_name(self.cfg)} is ready "
                f"by the Kubernetes API though its Jobs API at {handle.address} does not answer here: "
                "not deleting it"
            )
        return self.down(handle, run)

    def down(self, handle: ClusterHandle, run: str | None = None) -> str:
        from kubernetes.client.exceptions import ApiException

        k, name = self.cfg.cluster.kuberay, cluster_name(self.cfg)
        try:
            self._custom().delete_namespaced_custom_object(GROUP, VERSION, k.namespace, PLURAL, name)
        except ApiException as e:
            if e.status != 404:
                raise ClusterError(f"Kubernetes API: deleting RayCluster {name}: {_why(e)}") from e
        if not k.auth_secret:
            try:
                self._core().delete_namespaced_secret(token_secret_name(self.cfg), k.namespace)
            except ApiException as e:
                if e.status != 404:
                    secret = token_secret_name(self.cfg)
                    raise ClusterError(f"Kubernetes API: deleting Secret {secret}: {_why(e)}") from e
        return f"deleted RayCluster {k.namespace}/{name}"

    # -- what a run killed before its ``down`` left behind --------------------------------------------------------
    @classmethod
    def janitor_index(cls, storage: str) -> str:
        return Layout(storage).janitor_index(cls.name)

    def janitor_scope(self) -> str:
        """One look per namespace (of a context), however many runs used it."""
        k = self.cfg.cluster.kuberay
        return f"namespace {k.namespace}" + (f" of context {k.context}" if k.context else "")

    def janitor(self, is_over: Callable[[str, str], bool]) -> list[str]:
        """Delete the RayClusters unbroken made in this namespace for runs of this storage whose run is over --
        ``is_over(storage, run)`` decides (a finished, failed or vanished run that did not ask to keep its cluster).
        Another storage's clusters in a shared namespace are never this janitor's: their records may be where it
        cannot read them, and a record it cannot see is no evidence of a run over. Returns their names."""
        k = self.cfg.cluster.kuberay
        selector = ",".join(f"{a}={b}" for a, b in MANAGED_BY.items())
        found = self._custom().list_namespaced_custom_object(
            GROUP, VERSION, k.namespace, PLURAL, label_selector=selector
        )
        listed = cast(RayClusterList, found)  # the client annotates ``object``: the decoded JSON list, a dict
        deleted = []
        for obj in listed.get("items", []):
            meta: ObjectMeta = obj.get("metadata") or {}
            notes = meta.get("annotations") or {}
            storage, run, name = notes.get(STORAGE_ANNOTATION), notes.get(RUN_LABEL), meta.get("name")
            tag = (meta.get("labels") or {}).get(STORAGE_LABEL)
            mine = storage == self.cfg.storage and tag in (None, storage_tag(self.cfg.storage))  # (None: made before)
            if not mine or not run or not name or not is_over(storage, run):
                continue
            other = self.cfg.model_copy(deep=True)
            other.cluster.kuberay.name = name
            KubeRay(other, self._api()).down(ClusterHandle("", "", True, "", backend=self.name), run)
            deleted.append(name)
        return deleted


def _why(e: ApiException) -> str:
    """An ApiException as one line: the Status message the API server sent, or the HTTP reason."""
    import json

    try:
        return f"HTTP {e.status}: {json.loads(e.body or '').get('message')}"  # no body: the reason
    except (TypeError, ValueError, AttributeError):
        return f"HTTP {e.status}: {e.reason}"


BACKEND = KubeRay
