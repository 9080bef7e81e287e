"""Provision the Ray cluster through its backend (unbroken/backends): ``up`` then ``health``; release it when the
run is done with it."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config
from tasks.logs import run_logger
from unbroken.backends import backend_for, fit
from unbroken.backends.base import ClusterError, ClusterHandle

__all__ = ["ClusterError", "ClusterHandle", "check_cluster_fits", "provision_cluster", "stop_cluster"]


@task(name="provision-cluster", cache_policy=NO_CACHE)
def provision_cluster(cfg: Config) -> ClusterHandle:
    """The backend's ``up`` (start a local head, check an address, launch or repair a ``ray up`` cluster, create a
    RayCluster), then one look at its health, logged; returns how to reach it."""
    log = run_logger()
    backend = backend_for(cfg)
    handle = backend.up(cfg.name)
    if backend.name == "local":
        verb = "started" if handle.started_here else "reusing already running"
        log.info("%s local Ray head; dashboard: %s", verb, handle.dashboard_url)
    else:
        verb = "brought up" if handle.started_here else "using"
        log.info("%s Ray cluster (backend %s) at %s", verb, backend.name, handle.address)
    h = backend.health(handle)
    if h.nodes is None:
        log.info("cluster health not read: %s", h.why)
    else:
        gpus = sum(n.gpus for n in h.alive)
        log.info("cluster health: %d node(s) alive, %g CPUs, %g GPUs", len(h.alive), sum(n.cpus for n in h.alive), gpus)
    return handle


def begin_cluster(cfg: Config):
    """Start bringing the run's cluster up in the background of this process, before any flow runs (``unbroken run``
    does, while Prefect's server boots); the flow's provision-cluster takes it over. Returns what to ``release()``
    once the flow ended (a cluster it never took is let go), or None when the backend starts nothing ahead."""
    return backend_for(cfg).begin_up(cfg.name)


@task(name="check-cluster-fits", cache_policy=NO_CACHE)
def check_cluster_fits(cfg: Config, handle: ClusterHandle, manifest: dict) -> None:
    """Refuse a run that could never start (unbroken/backends/fit.py): a dataset without a train shard for every
    data rank, or a cluster without room for the fewest workers after waiting ``cluster.start_timeout_s`` for nodes
    to join. Raises DoesNotFit naming every reason; a cluster whose resources cannot be read is not refused here."""
    log = run_logger()
    backend = backend_for(cfg)
    health = backend.health(handle)
    if health.nodes is None:
        problems = fit.data_problems(cfg, manifest)
        log.warning("cluster resources not read (%s): room for the workers not checked", health.why)
    else:
        problems = fit.check_fit(cfg, fit.resources(health), manifest)
        if problems and not fit.data_problems(cfg, manifest):  # nodes may still be joining: wait a while
            log.info("waiting up to %g s for room: %s", cfg.cluster.start_timeout_s, "; ".join(problems))
            problems = fit.wait_for_room(cfg, lambda: fit.resources(backend.health(handle)))
    if problems:
        raise fit.DoesNotFit("the run cannot start: " + "; ".join(problems))


@task(name="stop-cluster", cache_policy=NO_CACHE)
def stop_cluster(cfg: Config, handle: ClusterHandle, run: str | None = None) -> None:
    """This run is done with its cluster: the backend's ``down`` -- a local head stops when no other run uses it (its
    users and ``keep_running`` are the head's own record); any other cluster goes only when this run brought it up
    and did not ask to keep it (an existing cluster, or one an earlier run left up, is never taken down)."""
    if handle.backend != "local" and (cfg.cluster.keep_running or not handle.started_here):
        why = "cluster.keep_running" if cfg.cluster.keep_running else "this run did not bring it up"
        run_logger().info("leaving the Ray cluster up (%s): %s", why, handle.dashboard_url)
        return
    run_logger().info(backend_for(cfg).down(handle, run))
