"""The watchdog's hands: carry out a :class:`~control.watchdog.decide.Decision`, one side effect per action, in
order, under the run's lease. Thin on purpose -- what to do was decided already; the one action that is re-checked
first is the restart (it may come a backoff after the trouble was seen): it looks at the job once more right before
it stops anything, and the lease is checked (fencing) right before it submits."""

from __future__ import annotations

import contextlib
import time

from control import lease as leases
from control import registry, series
from control.backends import backend_for
from control.backends.base import ClusterError, ClusterHandle, StopUnverified
from control.cluster import provision, release
from control.jobs import entrypoint, stop_and_wait, submit, write_job_spec
from control.logs import run_logger
from control.records.run import Incident, RunRecord
from control.tracking import end_tracker_runs
from control.watchdog.decide import (
    Decision,
    FinishSeries,
    GiveUp,
    Log,
    Outcome,
    ReleaseCluster,
    ReplaceNodes,
    Restart,
    Save,
    finish,
    restarted,
    resumed_step,
    stand_down,
)
from control.watchdog.observe import look, recorded_handle
from control.watchdog.verdict import classify
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config
from ray_jobs.storage import Layout

STOP_WAIT_S = 60.0


def act(decision: Decision, cfg: Config, lease: leases.Lease) -> Outcome:
    """Carry out ``decision``; what came of it (a restart reports the attempt it started, or that it stood down)."""
    reg, outcome = decision.record, decision.outcome
    for action in decision.actions:
        if isinstance(action, Save):
            registry.save(cfg.storage, cfg.name, reg)
        elif isinstance(action, Log):
            getattr(run_logger(), action.level)(action.message)
        elif isinstance(action, ReplaceNodes):
            _replace_nodes(cfg, reg, action.detail)
        elif isinstance(action, GiveUp):
            with contextlib.suppress(ClusterError):  # giving up must not hinge on reaching the cluster
                stop_leftovers(cfg, reg, reg.current.submission_id)
            registry.save(cfg.storage, cfg.name, reg)
            end_tracker_runs(cfg, "FAILED", "the watchdog gave up on it")
            if reg.kind == "search":
                series.end_unfinished(cfg.storage, cfg.name, "the watchdog gave up on its search")
        elif isinstance(action, ReleaseCluster):
            with contextlib.suppress(ClusterError):  # release leaves alone a cluster the run did not bring up
                release(cfg, recorded_handle(reg), run=cfg.name)
        elif isinstance(action, FinishSeries):
            series.finish_run(cfg.storage, cfg.name)
        elif isinstance(action, Restart):
            outcome = restart(cfg, reg, lease)
    return outcome


def restart(cfg: Config, reg: RunRecord, lease: leases.Lease) -> Outcome:
    """Stop what is left, re-provision if needed, resume from the newest valid checkpoint under a new submission."""
    again = look(cfg, reg, time.time())  # decided maybe a backoff ago: look again
    verdict = classify(again.job, reg.current, again.heartbeat, cfg, again.now, reg.cluster.address, again.error)
    if not verdict.trouble:
        return _stand_down(cfg, reg, verdict, again)
    stop_leftovers(cfg, reg, reg.current.submission_id)  # verified, or this raises and nothing is submitted
    lease.renew()
    handle = provision(cfg)  # starts a local head again if it is gone, repairs or brings up a managed cluster
    lease.renew()
    incident = reg.open_incident()
    resume_from, incident.lost_steps, where = resume_point(cfg, reg, incident)
    lease.check()  # fencing: never submit on a lease another watchdog has taken over
    registry.save(cfg.storage, cfg.name, reg)  # begin_attempt re-reads the record: ours (the incident) first
    attempt = _begin(cfg, reg, handle, resume_from, lease)
    spec = write_job_spec(cfg, attempt, reg.manifest_url, reg.model_path, resume_from, reg.score_manifest_url,
                          reg.parent)  # fmt: skip
    sid = submit(handle, registry.submission_id(cfg.name, attempt), entrypoint(cfg), spec)
    reg = registry.load(cfg.storage, cfg.name)
    incident = restarted(reg, attempt, sid, resume_from, handle.started_here, time.time())
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().warning("run %s: restarted as attempt %d (%s) from %s; %d steps lost", cfg.name, attempt, sid, where,
                         incident.lost_steps)  # fmt: skip
    return Outcome(cfg.name, "restarted", f"attempt {attempt} from {where}", incident)


def resume_point(cfg: Config, reg: RunRecord, incident: Incident) -> tuple[str | None, int, str]:
    """(checkpoint to resume from, steps lost: trained before the failure, to be trained again, what the restart
    resumes from in words). A search resumes its Ray Tune experiment, each running trial from its own newest
    checkpoint: no checkpoint of the search's own, and the lost steps are its running trials'."""
    if reg.kind == "search":
        return (
            None,
            series.lost_steps(cfg.storage, cfg.name),
            "its Ray Tune experiment (each unfinished trial from its own newest checkpoint)",
        )
    found = ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(cfg.name))
    resume_from = found[0] if found else None
    lost = max(0, (incident.failed_step or 0) - resumed_step(resume_from))
    where = f"checkpoint at step {resumed_step(resume_from)}" if resume_from else "scratch (no valid checkpoint yet)"
    return resume_from, lost, where


def _begin(cfg: Config, reg: RunRecord, handle: ClusterHandle, resume_from: str | None, lease: leases.Lease) -> int:
    """Record the new attempt (the cluster it runs on owed a release if this run brought it up, now or before)."""
    owned = handle.started_here or (reg.cluster.started_here and reg.cluster.address == handle.address)
    extra = {k: getattr(reg, k) for k in ("manifest_url", "model_path", "score_manifest_url")}
    return registry.begin_attempt(cfg, handle.to_dict() | {"started_here": owned}, reg.dataset_id,
                                  resume_from=resume_from, started_by="watchdog", extra=extra, lease=lease)  # fmt: skip


def _stand_down(cfg: Config, reg: RunRecord, verdict, again) -> Outcome:
    incident = reg.open_incident()
    stand_down(reg, incident, verdict, again.now)
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().warning("run %s: %s no longer holds; not restarting", cfg.name, incident.kind)
    if verdict.kind == "succeeded":
        return act(finish(reg, verdict, again, cfg), cfg, None)
    return Outcome(cfg.name, "ok", f"{incident.kind} cleared on re-check: {verdict.status}", incident)


def stop_leftovers(cfg: Config, reg: RunRecord, sid: str) -> None:
    """Make sure the failed attempt's job no longer runs before another is submitted: stop it and wait until Ray
    says it ended. When the cluster cannot tell (unreachable), its backend takes down what ends the job for certain
    (``stop_unreachable``: a local head of ours by its processes, a cluster unbroken brought up through its
    ``down``); anyone else's cluster: StopUnverified, and no new attempt -- two jobs must never train into the same
    checkpoints."""
    address = reg.cluster.address
    try:
        if stop_and_wait(address, sid, STOP_WAIT_S):
            run_logger().info("stopped what was left of Ray job %s", sid)
    except StopUnverified:  # the backend's to end for certain, or StopUnverified again
        done = backend_for(cfg).stop_unreachable(recorded_handle(reg), cfg.name)
        run_logger().warning("the Ray cluster at %s does not answer: %s", address, done)


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
