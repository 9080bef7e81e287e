"""Cluster backends: the ways a run gets its Ray cluster (``cluster.backend``), behind one interface
(:class:`~control.backends.base.Backend`) that the finetune flow and the watchdog both call -- re-provisioning after
a cluster died is the same code for every backend, and what only one backend knows (its config checks, its repairs,
what to stop when it stops answering, its cleanup) is that backend's. Backend names are compared here and in the typed
config (which settings belong to which backend), nowhere else.

A backend is registered once, by its name in the typed config's ``BackendName`` (ray_jobs/config/cluster.py: the
config cannot import the control plane, so the list lives there): ``control/backends/<name>.py`` (a "-" in the name is
a "_" in the module's) and its ``BACKEND`` class are found from that name.

- ``local``: a head on this machine (control/backends/local.py)
- ``address``: an existing cluster's Jobs API (control/backends/address.py)
- ``ray-up``: the Ray cluster launcher from a cluster YAML (control/backends/ray_up.py)
- ``kuberay``: a RayCluster on Kubernetes (control/backends/kuberay.py)
"""

from __future__ import annotations

from importlib import import_module
from typing import get_args

from control.backends.base import Backend, ClusterError, ClusterHandle, ClusterSeen, StopUnverified
from control.records.run import ClusterRecord
from ray_jobs.config import BackendName, ClusterConfig, Config
from ray_jobs.secrets import reveal, reveal_tree

__all__ = [
    "BACKENDS", "Backend", "ClusterError", "ClusterHandle", "ClusterSeen", "StopUnverified", "backend_class",
    "backend_for", "backend_problems", "handle_from_record", "janitor_backends", "record", "recorded_backend",
]  # fmt: skip

# The registered names, in the config's order. Each backend's module is imported when first asked for (kuberay's
# client, the launcher's SDK are heavy).
BACKENDS: tuple[str, ...] = get_args(BackendName)


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise ClusterError(f"cluster.backend: unknown backend {name!r} (one of: {', '.join(BACKENDS)})")
    return import_module(f"control.backends.{name.replace('-', '_')}").BACKEND


def backend_for(cfg: Config) -> Backend:
    """The backend ``cfg.cluster`` names (``cluster.backend``; unset: ``address`` when an address is given, else
    ``local``)."""
    return backend_class(cfg.cluster.backend_name)(cfg)


def backend_problems(cluster: ClusterConfig, storage: str) -> list[str]:
    """The checks of the backend ``cluster`` names (control/config.py runs them with the rest of the config's)."""
    return backend_class(cluster.backend_name).problems(cluster, storage)


def record(cfg: Config, cluster: ClusterSeen) -> ClusterRecord:
    """The run record's ``cluster`` for the cluster a run got (a handle's dict, or the part of one a caller knows;
    without a ``backend``, the config's)."""
    return backend_class(cluster.get("backend") or cfg.cluster.backend_name).record(cluster)


def handle_from_record(rec: ClusterRecord) -> ClusterHandle:
    """The run's cluster as its record has it, its address (and spec) revealed with this process's
    ``UNBROKEN_CREDENTIALS`` (recorded masked). Records written before backends existed have only ``mode``: a local
    head, or an existing cluster."""
    rec = rec.model_copy(update={"address": reveal(rec.address), "spec": reveal_tree(rec.spec)})
    return recorded_backend(rec).handle_from_record(rec)


def recorded_backend(rec: ClusterRecord) -> type[Backend]:
    """The backend of a run's recorded cluster (records written before backends existed have only ``mode``: a local
    head, or an existing cluster)."""
    return backend_class(rec.backend or ("local" if rec.mode == "local" else "address"))


def janitor_backends() -> list[type[Backend]]:
    """The backends that leave something behind for a janitor when a run ends without its ``down``."""
    default = Backend.janitor_index.__func__
    return [cls for cls in map(backend_class, BACKENDS) if cls.janitor_index.__func__ is not default]
