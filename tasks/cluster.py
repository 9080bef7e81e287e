"""Provision the Ray cluster through its backend: ``up`` then ``health``; check the run fits; release it when the
run is done with it (the work is control/cluster.py; these are its Prefect tasks)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from control import cluster
from control.backends.base import ClusterError, ClusterHandle
from ray_jobs.config import Config
from ray_jobs.contracts.dataset import DatasetManifest

__all__ = ["ClusterError", "ClusterHandle", "begin_cluster", "check_cluster_fits", "provision_cluster", "stop_cluster"]

begin_cluster = cluster.begin


@task(name="provision-cluster", cache_policy=NO_CACHE)
def provision_cluster(cfg: Config) -> ClusterHandle:
    """The backend's ``up`` (start a local head, check an address, launch or repair a ``ray up`` cluster, create a
    RayCluster), then one look at its health, logged; returns how to reach it."""
    return cluster.provision(cfg)


@task(name="check-cluster-fits", cache_policy=NO_CACHE)
def check_cluster_fits(cfg: Config, handle: ClusterHandle, manifest: DatasetManifest) -> None:
    """Refuse a run that could never start (a dataset without a train shard for every data rank, a cluster without
    room for the fewest workers after ``cluster.start_timeout_s``), naming every reason."""
    cluster.check_fits(cfg, handle, manifest)


@task(name="stop-cluster", cache_policy=NO_CACHE)
def stop_cluster(cfg: Config, handle: ClusterHandle, run: str | None = None) -> None:
    """This run is done with its cluster: the backend's ``down`` where the run may take it down."""
    cluster.release(cfg, handle, run)
