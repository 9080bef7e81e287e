"""The watchdog's hands: carry out a :class:`~control.watchdog.decide.Decision`, one side effect per action, in
order, under the run's lease. Thin on purpose -- what to do was decided already, and nothing here decides: a
``Restart`` is the pass's to look at again and decide on (decide.recheck) right before it happens, which comes back
here as a ``Resubmit`` (control/watchdog/restart.py) or a stand-down's actions. Every write of the run record is
fenced (the lease is checked right before it: a watchdog that stalled past its lease and lost it writes nothing)."""

from __future__ import annotations

import contextlib

from control import lease as leases
from control import registry, series
from control.attempt import close_run
from control.backends import backend_for
from control.backends.base import ClusterError
from control.cluster import release
from control.logs import run_logger
from control.records.run import RunRecord
from control.tracking import end_tracker_runs
from control.watchdog.decide import (
    CloseRun,
    Decision,
    GiveUp,
    Log,
    Outcome,
    Reattach,
    ReleaseCluster,
    ReplaceNodes,
    Resubmit,
    Save,
)
from control.watchdog.observe import recorded_handle
from control.watchdog.reattach import reattach
from control.watchdog.restart import resubmit, stop_leftovers
from ray_jobs.config import Config


def act(decision: Decision, cfg: Config, lease: leases.Lease) -> Outcome:
    """Carry out ``decision``; what came of it (a restart reports the attempt it started, or that it stood down)."""
    reg, outcome = decision.record, decision.outcome
    for action in decision.actions:
        if isinstance(action, Save):
            save(cfg, reg, lease)
        elif isinstance(action, Log):
            getattr(run_logger(), action.level)(action.message)
        elif isinstance(action, ReplaceNodes):
            _replace_nodes(cfg, reg, action.detail)
        elif isinstance(action, GiveUp):
            give_up(cfg, reg, lease)
        elif isinstance(action, ReleaseCluster):
            with contextlib.suppress(ClusterError):  # release leaves alone a cluster the run did not bring up
                release(cfg, recorded_handle(reg), run=cfg.name)
        elif isinstance(action, CloseRun):
            with contextlib.suppress(ClusterError):  # scored first; a cluster the run did not bring up is left alone
                close_run(cfg, recorded_handle(reg))
        elif isinstance(action, Resubmit):
            outcome = resubmit(cfg, reg, lease)
        elif isinstance(action, Reattach):
            reattach(cfg, reg, lease)
    return outcome


def save(cfg: Config, reg: RunRecord, lease: leases.Lease | None) -> None:
    """Write the run record, fenced: only while this watchdog's lease is still the run's (LeaseLost otherwise)."""
    if lease is not None:
        lease.check()
    registry.save(cfg.storage, cfg.name, reg)


def give_up(cfg: Config, reg: RunRecord, lease: leases.Lease) -> None:
    """Stop what is left of the job (best effort: giving up must not hinge on reaching the cluster, and a job's
    processes Ray had already ended are stopped too where the backend can), record the run failed, end its trackers'
    runs (a search's trials too)."""
    sid = reg.current.submission_id
    if reg.cluster is not None:  # a record without one has no cluster to stop anything on
        with contextlib.suppress(ClusterError):
            stop_leftovers(cfg, reg, sid)
        with contextlib.suppress(ClusterError):
            backend_for(cfg).stop_job(recorded_handle(reg), sid)
    save(cfg, reg, lease)
    end_tracker_runs(cfg, "FAILED", "the watchdog gave up on it")
    if reg.kind == "search":
        series.end_unfinished(cfg.storage, cfg.name, "the watchdog gave up on its search")


def _replace_nodes(cfg: Config, reg: RunRecord, detail: str) -> None:
    """Ask the run's backend for its missing nodes back, if it repairs lost nodes (``replace_nodes``); what it did
    goes on the finding's incident."""
    incident = next(i for i in reversed(reg.incidents) if i.action == "noted" and i.detail == detail)
    backend = backend_for(cfg)
    try:
        done = backend.replace_nodes(cfg.name)
    except ClusterError as e:
        run_logger().warning("run %s: could not ask for replacement nodes: %s", cfg.name, e)
        incident.repair = f"{backend.name} up failed: {e}"[:300]
        return
    if done is not None:
        run_logger().info("run %s: asked %s for replacement nodes: %s", cfg.name, backend.name, done)
        incident.repair = done
