"""The watchdog's one action that is re-checked before it happens: a restart (it may come a backoff after the trouble
was seen), carried out once the pass has looked at the job once more and decided on that look (decide.recheck). It
makes sure the old job is over -- Ray says it ended *and* its heartbeat
has gone quiet, its processes stopped where the backend can reach them; when the cluster does not answer, ended for
certain by the backend on evidence of its own -- re-provisions with the lease kept alive, resumes from the newest
valid checkpoint, and checks the lease (fencing) right before it submits. A restart that cannot complete (the old
job's end cannot be verified, the cluster cannot be provisioned) is a failed restart: recorded on the incident,
counted against the budget and backed off, so a cluster gone for good ends in a give-up, not a loop."""

from __future__ import annotations

import time
from dataclasses import replace

from control import jobsapi, lifecycle, registry, series
from control import lease as leases
from control.attempt import start_attempt
from control.backends import backend_for
from control.backends.base import ClusterError, ClusterHandle, StopUnverified
from control.cluster import provision
from control.jobcode import entrypoint, user_code
from control.jobs import stop_and_wait, submit
from control.logs import run_logger
from control.rayapi import first_line
from control.records.run import Incident, RunRecord
from control.runhost import stop_run_host
from control.watchdog import credentials
from control.watchdog.decide import Outcome, resumed_step
from control.watchdog.observe import heartbeat_seen, recorded_handle
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config
from ray_jobs.contracts.base import RecordError
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.poll import poll_until
from ray_jobs.storage import Layout

STOP_WAIT_S = 60.0


def resubmit(cfg: Config, reg: RunRecord, lease: leases.Lease) -> Outcome:
    """Stop what is left, re-provision if needed, resume from the newest valid checkpoint under a new submission --
    decided on a look taken right before (decide.recheck)."""
    incident = reg.open_incident()
    assert incident is not None, "a restart is decided only for an open incident (decide.handle_incident)"
    try:
        stop_leftovers(cfg, reg, reg.current.submission_id)  # verified, or StopUnverified: nothing is submitted
        _seen_to_stop(cfg, reg, incident)
        with lease.kept():  # provisioning may take longer than the lease lasts
            handle = provision(cfg)  # a local head again if it is gone; a managed cluster repaired or brought up
    except ClusterError as e:
        return failed_restart(cfg, reg, incident, e, lease)
    return _resubmit(cfg, reg, incident, handle, lease)


def _resubmit(cfg: Config, reg: RunRecord, incident: Incident, handle: ClusterHandle, lease: leases.Lease) -> Outcome:
    resume_from, incident.lost_steps, where = resume_point(cfg, reg, incident)
    env = credentials.for_resubmission(reg)  # before the attempt it replaces is superseded in the record
    code = user_code(cfg, lambda: jobsapi.job_user_code(reg.recorded_cluster.url(), reg.current.submission_id))
    lease.check()  # fencing: never record or submit on a lease another watchdog has taken over
    registry.save(cfg.storage, cfg.name, reg)  # begin_attempt re-reads the record: ours (the incident) first
    attempt, spec = _begin(cfg, reg, handle, resume_from, lease)
    lease.check()
    with lease.kept():  # a submission may wait minutes for an answer: no second watchdog meanwhile
        try:
            sid = registry.submission_id(cfg.storage, cfg.name, attempt)
            sid = submit(handle, sid, entrypoint(cfg), spec, env, code=code)
        except Exception as e:  # refused, unanswered, a runtime env that failed: whatever it was, no job to watch
            return _submission_failed(cfg, attempt, e, lease)
    reg = registry.load_existing(cfg.storage, cfg.name)
    incident = restarted(reg, attempt, sid, resume_from, handle.started_here, time.time())
    lease.check()
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().warning(
        "run %s: restarted as attempt %d (%s) from %s; %d steps lost",
        cfg.name,
        attempt,
        sid,
        where,
        incident.lost_steps,
    )
    return Outcome(cfg.name, "restarted", f"attempt {attempt} from {where}", incident)


def _begin(
    cfg: Config, reg: RunRecord, handle: ClusterHandle, resume_from: str | None, lease: leases.Lease
) -> tuple[int, str]:
    """Record the new attempt with its job spec, under the lease (the cluster it runs on owed a release if this run
    brought it up, now or before)."""
    was = reg.recorded_cluster
    owned = handle.started_here or (was.started_here and was.url() == handle.address)
    if reg.inputs is None or reg.dataset_id is None:  # a flow records them with every attempt
        raise RecordError(f"run {cfg.name}: its record lacks what a resubmission needs (its inputs, dataset_id)")
    # what the run was given, but its sample generations: nobody is left to publish them (the flow's summary's)
    inputs = reg.inputs.model_copy(update={"samples": False})
    return start_attempt(
        cfg,
        replace(handle, started_here=owned).to_dict(),
        reg.dataset_id,
        inputs,
        resume_from=resume_from,
        started_by="watchdog",
        lease=lease,
    )


def _submission_failed(cfg: Config, attempt: int, e: Exception, lease: leases.Lease) -> Outcome:
    """The new attempt was recorded but its submission failed: the attempt ends FAILED (never "still submitting": a
    job that was never made would look healthy for ``stall_timeout_s``, and the incident close uncounted) and the
    restart is a failed try -- counted against the budget, backed off, retried (the next try stops the job first,
    should the submission have made one after all), and given up on, naming why, once the budget is spent."""
    reg = registry.load_existing(cfg.storage, cfg.name)
    incident = reg.open_incident()
    assert incident is not None, "the restart acts on the run's open incident, saved before the new attempt began"
    current = reg.current
    if current.attempt == attempt:
        current.set(status="FAILED", ended_at=time.time(), message=first_line(f"its submission failed: {e}"))
        lifecycle.move(reg, "recovering")
    return failed_restart(cfg, reg, incident, e, lease)


def failed_restart(cfg: Config, reg: RunRecord, incident: Incident, e: Exception, lease: leases.Lease) -> Outcome:
    """A restart that could not complete: counted on the incident (against the budget, and for the backoff before the
    next try); the run stays ``recovering`` until a try completes or a rule gives up on it."""
    now, why = time.time(), first_line(f"{type(e).__name__}: {e}")
    incident.set(failed_tries=(incident.failed_tries or 0) + 1, last_try_at=now, action="waiting", last_try_error=why)
    lease.check()
    registry.save(cfg.storage, cfg.name, reg)
    run_logger().warning("run %s: restart %d could not complete: %s", cfg.name, incident.failed_tries, why)
    return Outcome(cfg.name, "restart-failed", why, incident)


def still_beating(cfg: Config, reg: RunRecord) -> Beat | None:
    """The current attempt's heartbeat if its processes still write it -- it moves twice within a few of its beats
    (once more may be a dying writer's last word) -- though Ray, or the silence, says the job is over: a driver
    orphaned by its wrapper's death trains on, and a restart now would train twice into one folder. None once it is
    quiet."""
    first, age = heartbeat_seen(cfg.storage, cfg.name, reg.current.attempt)
    window = 3 * cfg.fault_tolerance.heartbeat_every_s + 1.0
    if first is None or age is None or age > window:  # age is None exactly when first is
        return None
    seen = {first.time}
    last: list[Beat] = []

    def moved_twice() -> bool:
        beat, _ = heartbeat_seen(cfg.storage, cfg.name, reg.current.attempt)
        if beat is not None and beat.time not in seen:
            seen.add(beat.time)
            last[:] = [beat]
        return len(seen) > 2

    moving = poll_until(moved_twice, window, every_s=max(0.1, cfg.fault_tolerance.heartbeat_every_s / 2))
    return last[0] if moving else None


def _seen_to_stop(cfg: Config, reg: RunRecord, incident: Incident) -> None:
    """Nothing new is submitted while the old job's processes still write its heartbeat: they are stopped where the
    backend can reach them (a local head's, by their mark) and must then go quiet; StopUnverified otherwise (a
    failed try, retried after a backoff -- if they finish the run meanwhile, the next look finds it succeeded)."""
    backend, handle, sid = backend_for(cfg), recorded_handle(reg), reg.current.submission_id
    # Seen directly where the backend can: no process of it is left to write its heartbeat (a local head's killed
    # driver; Ray ends its workers within a few seconds): the restart does not wait out a few heartbeats
    window = 3 * cfg.fault_tolerance.heartbeat_every_s + 1.0
    seen = backend.job_gone(handle, sid)
    if seen or (seen is not None and poll_until(lambda: backend.job_gone(handle, sid), window, every_s=0.2)):
        run_logger().info("run %s: no process of job %s is left; not waiting on its heartbeat", cfg.name, sid)
        return
    # A job Ray just ended may still be saving its just-in-time checkpoint (SIGTERM'd workers): given that long
    if poll_until(lambda: still_beating(cfg, reg) is None, cfg.fault_tolerance.preemption_grace_s, every_s=0):
        return
    done = backend.stop_job(handle, sid)
    if done is not None:
        run_logger().warning("run %s: %s", cfg.name, done)
        if still_beating(cfg, reg) is None:
            return
    beat = heartbeat_seen(cfg.storage, cfg.name, reg.current.attempt)[0]
    raise StopUnverified(
        f"attempt {reg.current.attempt}'s processes still write its heartbeat (step "
        f"{beat.step if beat else None}) though its job is {incident.kind}: nothing new is submitted until "
        "they stop"
    )


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


def stop_leftovers(cfg: Config, reg: RunRecord, sid: str) -> None:
    """Make sure the failed attempt's job no longer runs before another is submitted: stop it and wait until Ray
    says it ended, and its run host (``fault_tolerance.run_host``) if one is left. When the cluster cannot tell
    (unreachable), its backend ends the job for certain on evidence of its own (``stop_unreachable``: a local head's
    processes on this host, a launcher's head that refuses its GCS port too, a RayCluster the Kubernetes API calls
    unhealthy) or raises StopUnverified, and no new attempt is made -- two jobs must never train into the same
    checkpoints."""
    address = reg.recorded_cluster.url()
    try:
        if stop_and_wait(address, sid, STOP_WAIT_S):
            run_logger().info("stopped what was left of Ray job %s", sid)
        # a run host outlives its driver: stopped by name (a head restarted under it, a frozen host)
        if stop_run_host(cfg, recorded_handle(reg), reg.current.attempt):
            run_logger().warning("stopped the run host of attempt %d of run %s", reg.current.attempt, cfg.name)
    except StopUnverified:  # the backend's to end for certain, or StopUnverified again
        done = backend_for(cfg).stop_unreachable(recorded_handle(reg), cfg.name, sid)
        run_logger().warning("the Ray cluster at %s does not answer: %s", address, done)


def restarted(
    reg: RunRecord, new_attempt: int, sid: str, resume_from: str | None, reprovisioned: bool, now: float
) -> Incident:
    """Record the restart on the run's open incident; the run is ``submitted`` again."""
    incident = reg.open_incident()
    assert incident is not None, "the restart acts on the run's open incident, saved before the new attempt began"
    incident.set(
        action="restarted",
        new_attempt=new_attempt,
        submission_id=sid,
        resumed_from=resume_from,
        resumed_step=resumed_step(resume_from) if resume_from else None,
        restarted_at=now,
        reprovisioned=reprovisioned,
    )
    reg.restarts += 1
    lifecycle.move(reg, "submitted")
    return incident
