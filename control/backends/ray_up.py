"""Backend ``ray-up``: the Ray cluster launcher, driven through its own SDK (``ray.autoscaler.sdk``) from the
cluster YAML the user gives (``cluster.ray_up.config``): a cloud provider's (configs/clusters/aws-gpu.yaml) or the
``local`` provider's list of machines reached over SSH (configs/clusters/onprem.yaml).

``up`` is ``ray up``: it starts the head when it does not answer, and otherwise updates the cluster in place without
restarting Ray (``no_restart``: a running job goes on); the head's autoscaler then starts whatever workers the YAML
asks for and are missing -- a worker host that died is started again. ``down`` is ``ray down``. The Jobs API is
reached at ``cluster.ray_up.dashboard_address`` (an SSH tunnel, a load balancer) or at the head's address.
Token auth: the YAML's start commands set ``RAY_AUTH_MODE=token`` and ship this machine's token
(``file_mounts``), so the flow's own token opens the cluster's Jobs API.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import socket
import tempfile
import time
from pathlib import Path
from types import ModuleType

import yaml

from control.backends.base import (
    Backend,
    ClusterError,
    ClusterHandle,
    StopUnverified,
    enable_token_auth,
    reachable,
    redact,
)
from control.records.run import ClusterSpec
from ray_jobs.config import ClusterConfig
from ray_jobs.poll import poll_until

DASHBOARD_PORT = 8265
GCS_PORT = 6379
HEAD_TRIES, HEAD_RETRY_S = 3, 2.0  # asking a head the launcher knows before taking it for dead
UP_POLL_S = 2.0  # between two looks for the Jobs API once the launcher is done
RECONNECT_S = 600  # the workers' GCS reconnect timeout under GCS fault tolerance (KubeRay's own value)


def yaml_problems(path: str, use_gpu: bool) -> list[str]:
    """The ``ray up`` cluster YAML: readable, a mapping naming the cluster and its provider, a GPU if asked for."""
    if not path:
        return ["cluster.ray_up.config: cluster.backend ray-up needs the cluster YAML (what `ray up` takes)"]
    try:
        text = Path(os.path.expanduser(path)).read_text(encoding="utf-8")
    except OSError as e:
        return [f"cluster.ray_up.config: cannot read {path}: {e.strerror or e}"]
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"cluster.ray_up.config: {path} is not valid YAML: {getattr(e, 'problem', e)}"]
    if not isinstance(spec, dict):
        return [f"cluster.ray_up.config: {path} is not a cluster YAML (a mapping with cluster_name, provider, ...)"]
    out = [f"cluster.ray_up.config: {path} has no {key}" for key in ("cluster_name", "provider") if not spec.get(key)]
    if use_gpu and not _declares_gpus(spec):
        out.append(
            f"cluster.use_gpu: the cluster YAML {path} gives none of its node types a GPU "
            "(available_node_types.*.resources)"
        )
    return out


# A cluster YAML as read (a mapping of whatever the launcher's schema allows; read here only where narrowed)
ClusterYaml = dict[str, object]


def _declares_gpus(spec: ClusterYaml) -> bool:
    """Whether some node type has a GPU; True too when the YAML does not declare its resources (the launcher then
    detects them on the nodes)."""
    types = spec.get("available_node_types")
    if not isinstance(types, dict):
        return True
    declared = [t.get("resources") for t in types.values() if isinstance(t, dict)]
    if not declared or not all(isinstance(r, dict) for r in declared):
        return True
    return any(r.get("GPU") for r in declared)


class RayUp(Backend):
    name = "ray-up"

    @classmethod
    def problems(cls, cluster: ClusterConfig, storage: str) -> list[str]:
        return yaml_problems(cluster.ray_up.config, cluster.use_gpu)

    def _yaml(self) -> ClusterYaml:
        return yaml.safe_load(Path(self.cfg.cluster.ray_up.config).read_text(encoding="utf-8"))

    def spec(self) -> ClusterSpec:
        return {"config": self.cfg.cluster.ray_up.config, "cluster_name": self._yaml().get("cluster_name")}

    def _sdk(self) -> ModuleType:
        """``ray.autoscaler.sdk``, imported when first needed, with token auth on."""
        enable_token_auth()
        from ray.autoscaler import sdk

        return sdk

    def _jobs_api(self) -> str | None:
        """The Jobs API URL: configured, or the head's address as the launcher knows it (None: no head)."""
        if self.cfg.cluster.ray_up.dashboard_address:
            return self.cfg.cluster.ray_up.dashboard_address
        try:
            ip = self._sdk().get_head_node_ip(self.cfg.cluster.ray_up.config)
        except Exception:  # the launcher raises RuntimeError (no head) or a provider's own error
            return None
        return f"http://{ip}:{DASHBOARD_PORT}"

    def address(self) -> str | None:
        address = self._jobs_api()
        return address if address and reachable(address) is None else None

    def _live_head(self) -> str | None:
        """The Jobs API of a head that is up, asked up to 3 times when the launcher knows a head: ``up`` on a head
        taken for dead restarts Ray there, and with it the running job -- one slow answer (a busy head) must not."""
        api = self._jobs_api()
        if api is None:
            return None
        # A count of tries, not a deadline (poll_until's): one try that takes its whole timeout must not use up the
        # others.
        for attempt in range(HEAD_TRIES):
            if reachable(api) is None:
                return api
            if attempt < HEAD_TRIES - 1:
                time.sleep(HEAD_RETRY_S)
        return None

    def up(self, run: str | None = None) -> ClusterHandle:
        path, limit = self.cfg.cluster.ray_up.config, self.cfg.cluster.ray_up.up_timeout_s
        already = self._live_head()
        provider = self._yaml().get("provider")
        if isinstance(provider, dict) and provider.get("type") == "local":
            # Ray 2.60's autoscaler v2 (ray up's default) never replaces a dead worker of the local provider: the
            # new instance waits on the dead one's IP, whose termination times out (seen here, 300 s and again). v1
            # replaces it. A user's explicit setting wins.
            os.environ.setdefault("RAY_UP_enable_autoscaler_v2", "0")
        launch = launch_yaml(path, self._yaml(), self.cfg.cluster.gcs_ft)
        try:
            # On a live cluster: update in place, Ray not restarted (running jobs go on); the head's autoscaler
            # starts the workers the YAML asks for that are missing.
            self._sdk().create_or_update_cluster(launch, no_restart=already is not None, no_config_cache=True)
        except Exception as e:  # the launcher's failures carry the provider's or SSH's message
            raise ClusterError(redact(f"ray up {path} failed: {type(e).__name__}: {e}")) from e
        address = poll_until(self.address, limit, every_s=UP_POLL_S)
        if address is None:
            api = self._jobs_api()
            why = reachable(api) if api else "the launcher reports no head"
            raise ClusterError(
                f"ray up finished but the Jobs API never answered within cluster.ray_up.up_timeout_s={limit:g}s: {why}"
            )
        return self._handle(address, already is None)

    def replace_nodes(self, run: str) -> str:
        """``up`` again: on a live cluster it updates in place without restarting Ray (the running job goes on), and
        the head's autoscaler starts Ray again on every listed host that answers. ClusterError when it failed."""
        self.up(run)
        return f"{self.name} up: replacement nodes requested"

    def stop_unreachable(self, handle: ClusterHandle, run: str, submission_id: str) -> str:
        """A cluster unbroken brought up whose Jobs API does not answer and whose job's heartbeat went quiet:
        ``ray down`` ends its job for certain -- but only once a second channel agrees the head is dead: the launcher
        knows no head, or the head's GCS port (``head_port``) refuses connections too. A head that still accepts them
        may be behind a port-forward that died: StopUnverified, nothing torn down."""
        ip = self._head_ip()
        if ip is not None and _accepts(ip, self._gcs_port()):
            raise StopUnverified(
                f"the Ray head at {ip} still accepts connections on its GCS port {self._gcs_port()} "
                f"though its Jobs API at {handle.address} does not answer: not tearing it down"
            )
        return self.down(handle, run)

    def _head_ip(self) -> str | None:
        try:
            return self._sdk().get_head_node_ip(self.cfg.cluster.ray_up.config)
        except Exception:  # the launcher raises RuntimeError (no head) or a provider's own error
            return None

    def _gcs_port(self) -> int:
        """The head's GCS port as the YAML starts it (``--port=N`` in head_start_ray_commands), else Ray's 6379."""
        listed = self._yaml().get("head_start_ray_commands")
        commands = " ".join(str(c) for c in listed) if isinstance(listed, list) else ""
        found = re.search(r"--port[= ](\d+)", commands)
        return int(found.group(1)) if found else GCS_PORT

    def down(self, handle: ClusterHandle, run: str | None = None) -> str:
        path = self.cfg.cluster.ray_up.config
        try:
            self._sdk().teardown_cluster(path)
        except Exception as e:
            raise ClusterError(redact(f"ray down {path} failed: {type(e).__name__}: {e}")) from e
        return f"tore the Ray cluster down (ray down {path})"


def _accepts(host: str, port: int, timeout_s: float = 5.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection (a live process listens there)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


BACKEND = RayUp


def gcs_ft_yaml(spec: ClusterYaml, redis: str) -> ClusterYaml:
    """The cluster YAML with GCS fault tolerance (``cluster.gcs_ft``): the head's start commands run with
    ``RAY_REDIS_ADDRESS`` (its GCS state kept in Redis, under a namespace of the cluster's name, so clusters may share
    one Redis), the workers' with a GCS reconnect timeout long enough for a head to come back (KubeRay's 600 s)."""
    name = str(spec.get("cluster_name") or "default")
    head = f"export RAY_REDIS_ADDRESS={shlex.quote(redis)} RAY_external_storage_namespace={shlex.quote(name)}; "
    worker = f"export RAY_gcs_rpc_server_reconnect_timeout_s={RECONNECT_S}; "
    out = dict(spec)
    for key, prefix in (("head_start_ray_commands", head), ("worker_start_ray_commands", worker)):
        listed = spec.get(key)
        if isinstance(listed, list):
            out[key] = [prefix + str(c) for c in listed]
    return out


def launch_yaml(path: str, spec: ClusterYaml, redis: str) -> str:
    """The YAML ``ray up`` is given: the user's own, or -- with ``cluster.gcs_ft`` -- a copy with GCS fault tolerance
    (:func:`gcs_ft_yaml`) in this machine's temp folder (the user's file is never rewritten)."""
    if not redis:
        return path
    text = yaml.safe_dump(gcs_ft_yaml(spec, redis), sort_keys=False)
    out = Path(tempfile.gettempdir()) / "unbroken-ray-up" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return str(out)
