"""Cluster backends: the ways a run gets its Ray cluster (``cluster.backend``), behind one interface
(:class:`~control.backends.base.Backend`: ``up``, ``address``, ``health``, ``down``) that the finetune flow and
the watchdog both call -- re-provisioning after a cluster died is the same code for every backend.

- ``local``: a head on this machine (control/backends/local.py)
- ``address``: an existing cluster's Jobs API (control/backends/address.py)
- ``ray-up``: the Ray cluster launcher from a cluster YAML (control/backends/rayup.py)
- ``kuberay``: a RayCluster on Kubernetes (control/backends/kuberay.py)
"""

from __future__ import annotations

from control.backends.base import Backend, ClusterError, ClusterHandle
from ray_jobs.config import Config

__all__ = ["Backend", "ClusterError", "ClusterHandle", "backend_for"]


def backend_for(cfg: Config) -> Backend:
    """The backend ``cfg.cluster`` names (``cluster.backend``; unset: ``address`` when an address is given, else
    ``local``)."""
    name = cfg.cluster.backend_name
    if name == "local":
        from control.backends.local import LocalHead

        return LocalHead(cfg)
    if name == "address":
        from control.backends.address import Address

        return Address(cfg)
    if name == "ray-up":
        from control.backends.rayup import RayUp

        return RayUp(cfg)
    if name == "kuberay":
        from control.backends.kuberay import KubeRay

        return KubeRay(cfg)
    raise ClusterError(f"cluster.backend: unknown backend {name!r}")
