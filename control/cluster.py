"""Bring a run's Ray cluster up through its backend (control/backends): ``up`` then a look at its health; check that
the run fits; release it when the run is done with it. The finetune flow calls these through tasks/cluster.py, the
watchdog directly."""

from __future__ import annotations

from control.backends import backend_class, backend_for, fit
from control.backends.base import ClusterError, ClusterHandle, StartedAhead
from control.logs import run_logger
from ray_jobs.config import Config
from ray_jobs.contracts.dataset import DatasetManifest

__all__ = ["ClusterError", "ClusterHandle", "begin", "check_fits", "preflight", "provision", "release"]


def provision(cfg: Config) -> ClusterHandle:
    """The backend's ``up`` (start a local head, check an address, launch or repair a ``ray up`` cluster, create a
    RayCluster), then one look at its health, logged; returns how to reach it."""
    log = run_logger()
    backend = backend_for(cfg)
    handle = backend.up(cfg.name)
    log.info(backend.announce(handle))
    h = backend.health(handle)
    if h.nodes is None:
        log.info("cluster health not read: %s", h.why)
    else:
        gpus = sum(n.gpus for n in h.alive)
        log.info("cluster health: %d node(s) alive, %g CPUs, %g GPUs", len(h.alive), sum(n.cpus for n in h.alive), gpus)
    return handle


def preflight(cfg: Config) -> None:
    """Before any work: a ConfigError naming the fields when the run's backend refuses the cluster it would get (a
    local head on the run's ports started from another checkout, interpreter or environment)."""
    backend_for(cfg).preflight()


def begin(cfg: Config) -> StartedAhead | None:
    """Start bringing the run's cluster up in the background of this process, before any flow runs (``unbroken run``
    does, while Prefect's server boots); the flow's provision-cluster takes it over. Returns what to ``release()``
    once the flow ended (a cluster it never took is let go), or None when the backend starts nothing ahead."""
    return backend_for(cfg).begin_up(cfg.name)


def check_fits(cfg: Config, handle: ClusterHandle, manifest: DatasetManifest) -> None:
    """Refuse a run that could never start (control/backends/fit.py): a dataset without a train shard for every
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


def release(cfg: Config, handle: ClusterHandle, run: str | None = None) -> None:
    """This run is done with its cluster: the backend's ``down`` -- a local head stops when no other run uses it (its
    users and ``keep_running`` are the head's own record); any other cluster goes only when this run brought it up
    and did not ask to keep it (an existing cluster, or one an earlier run left up, is never taken down): the
    handle's backend says (``leave_up``)."""
    why = backend_class(handle.backend).leave_up(cfg, handle)
    if why is not None:
        run_logger().info("leaving the Ray cluster up (%s): %s", why, handle.dashboard_url)
        return
    run_logger().info(backend_for(cfg).down(handle, run))
