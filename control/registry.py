"""The run registry: storing the run record ``<storage>/runs/<run>/run.json`` (its typed model and states are
control/records/run.py) and the changes the flow and the watchdog make to it.

Written atomically (whole-file replace), read by ``unbroken status`` and the watchdog. Writers: the finetune
flow (first attempt, its end) and the watchdog (incidents, later attempts) -- the watchdog only while it holds the
run's lease (control/lease.py), so two writers never interleave a read-modify-write on the same run.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from control import lease as leases
from control import lifecycle
from control.backends import ClusterSeen, backend_class
from control.backends import record as cluster_record
from control.records.run import ACTIVE, STATES, Attempt, Incident, RunRecord, State, storage_tag
from control.records.run import load_record as load
from control.resumable import RunConflict, check_resumable, pick
from ray_jobs.config import Config
from ray_jobs.contracts.base import RecordError
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.errors import UserError
from ray_jobs.storage import (
    Layout,
    StorageFull,
    exists,
    fs_and_path,
    join,
    listing,
    write_bytes_atomic,
    write_json_atomic,
)

__all__ = ["ACTIVE", "STATES", "RunBusy", "RunConflict", "begin_attempt", "end_attempt", "load", "pick", "save"]


def submission_id(storage: str, run: str, attempt: int, kind: str = "train") -> str:
    """Ray job submission id: derived from the storage, the run name and the attempt, so a retried submit is
    idempotent, and two runs of one name in two storages on one cluster (a team's shared cluster, two projects on
    one laptop's head) never take each other's job for their own. ``storage_tag``: which storage, in six hex digits."""
    return f"unbroken-{run}-{storage_tag(storage)}-{kind}-{attempt:03d}"


def load_existing(storage: str, run: str) -> RunRecord:
    """The run's record where one must exist (a run being closed, restarted or handed over); FileNotFoundError
    naming its file when it is gone."""
    reg = load(storage, run)
    if reg is None:
        raise FileNotFoundError(Layout(storage).run_registry(run))
    return reg


def save(storage: str, run: str, reg: RunRecord) -> None:
    reg.updated_at = time.time()
    active = reg.watched
    if active:  # the marker first: a crash in between leaves a marker the next look checks, never a hidden run
        _index(storage, run, True)
    write_json_atomic(Layout(storage).run_registry(run), reg.dump(), durable=True)
    if not active:
        _index(storage, run, False)


def _index(storage: str, run: str, active: bool) -> None:
    """Keep ``index/active-runs/<run>`` in step with the run's state (after run.json: the registry is the truth)."""
    _mark(Layout(storage).active_index(), run, active)


def _mark(folder: str, run: str, on: bool) -> None:
    marker = join(folder, run)
    if on:
        write_bytes_atomic(marker, b"")
    else:
        fs, path = fs_and_path(marker)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)


def _marked(folder: str) -> list[str]:
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in listing(folder))


def marked_runs(index: str) -> list[str]:
    """Runs marked in a janitor's ``index`` (control/backends: ``janitor_index``) that it has not yet seen cleaned
    up: one listing, so a watchdog pass never reads every run that ever finished."""
    return _marked(index)


def unmark(index: str, run: str) -> None:
    """The janitor is done with ``run``: its markers' folder no longer names it."""
    _mark(index, run, False)


def update(storage: str, run: str, **fields: Any) -> RunRecord:
    """Read, set top-level fields, write back; returns the new record."""
    reg = load_existing(storage, run)
    reg.set(**fields)
    save(storage, run, reg)
    return reg


def runs(storage: str) -> list[str]:
    """Names of every run with a registry under this storage."""
    names = sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in listing(join(storage, "runs")))
    return [n for n in names if exists(Layout(storage).run_registry(n))]


def active_runs(storage: str, unreadable: list[tuple[str, str]] | None = None) -> list[str]:
    """Runs the watchdog must look after: submitted, running, recovering, or succeeded and still to be closed. Read
    from the active-run index (one listing and a registry per active run, however many runs ever finished); a
    storage without one yet (written before the index existed) is scanned once to build it.

    A record this release cannot read (written by a newer one, hand-edited, torn by a host crash) never hides the
    others: it is left out, and ``(run, why)`` goes into ``unreadable`` (when given) for the caller to name and count.
    """
    names = _marked(Layout(storage).active_index())
    indexed = set(names)
    built = ".built" in indexed
    if not built:
        names = runs(storage)
    active = []
    for run in (n for n in names if not n.startswith(".")):  # .built; a run's name never starts with one
        try:
            reg = load(storage, run)
        except (RecordError, ValueError) as e:  # its marker stays: the next pass names it again
            if unreadable is not None:
                unreadable.append((run, str(e)))
            continue
        is_active = reg is not None and reg.watched
        if is_active and run not in indexed:  # heals a crash between run.json and the index, and builds it
            _index(storage, run, True)
        elif not is_active and run in indexed:
            _unmark_if_unwatched(storage, run)
        if is_active:
            active.append(run)
    if not built:  # only once every run was looked at: a scan cut short is redone next time
        write_bytes_atomic(join(Layout(storage).active_index(), ".built"), b"")
    return active


def _unmark_if_unwatched(storage: str, run: str) -> None:
    """A marker whose record is missing or not watched: a crash between the two writes of ``save`` -- or a save in
    flight this very moment (its marker written, its run.json not yet: a new run's first attempt, or a finished run
    started again), which must never lose its marker, or no watchdog would ever look at the run again. Every save
    that makes a run watched holds the run's lease (``begin_attempt``, ``adopt``, the watchdog's), so the marker goes
    only under that lease, on a fresh read; while someone holds it the marker stays for the next pass."""
    try:
        lease = leases.acquire(storage, run, ttl_s=30)
    except StorageFull:  # no room for a lease: the marker stays (a pass must go on for the other runs)
        return
    if lease is None:
        return
    with lease:
        try:
            reg = load(storage, run)
        except (RecordError, ValueError):  # unreadable now: named by the next pass, its marker kept
            return
        if reg is None or not reg.watched:
            _index(storage, run, False)


class RunBusy(UserError, RuntimeError):
    """The run already has an attempt in flight (a flow run or the watchdog looks after it): a second training job
    would write into the same checkpoints."""


def check_compatible(cfg: Config, dataset_id: str) -> None:
    """Refuse to reuse a run name whose earlier attempts used another dataset or a fixed field's other value
    (control/resumable.py: ``FIXED_FIELDS``)."""
    reg = load(cfg.storage, cfg.name)
    if reg is None or not reg.config:
        return
    check_resumable(reg.config, reg.dataset_id, cfg, dataset_id)


def begin_attempt(
    cfg: Config,
    cluster: ClusterSeen,
    dataset_id: str,
    inputs: AttemptInputs | None = None,
    *,
    resume_from: str | None = None,
    started_by: str = "finetune-flow",
    trials: list[str] | None = None,
    lease: leases.Lease | None = None,
    flow_run_id: str | None = None,
    job_spec: Callable[[int], object] | None = None,
) -> int:
    """Record a new attempt (state ``submitted``) and return its number (1-based).

    ``inputs``: what the attempt is given, kept in the record (what the watchdog resubmits without the flow);
    ``trials``: a search's trials' run names. A flow
    (``lease`` None) takes the run's lease for this write and is refused with RunBusy while another attempt is in
    flight; a watchdog passes the lease it holds. ``job_spec(attempt)`` writes what the attempt's job is given: called
    under the lease, after the busy check and before the attempt is recorded, so a flow that is refused never
    overwrites the job spec of the attempt that won. ``flow_run_id``: the flow run that starts it (its cancel and
    crash hooks act on this attempt alone).
    """
    args = (cfg, cluster, dataset_id, inputs, trials, resume_from, started_by, flow_run_id, job_spec)
    if lease is not None:
        lease.check()  # fenced: a watchdog that lost its lease records nothing
        return _begin(*args)
    with leases.acquire_wait(cfg.storage, cfg.name):
        return _begin(*args)


def _begin(
    cfg: Config,
    cluster: ClusterSeen,
    dataset_id: str,
    inputs: AttemptInputs | None,
    trials: list[str] | None,
    resume_from: str | None,
    started_by: str,
    flow_run_id: str | None,
    job_spec: Callable[[int], object] | None,
) -> int:
    reg = _record_to_begin(cfg, started_by)
    attempt = len(reg.attempts) + 1
    if job_spec is not None:
        job_spec(attempt)
    superseded = reg.open_incident() if started_by != "watchdog" else None
    if superseded is not None:  # a new flow run takes over a run the watchdog was about to restart
        superseded.set(action="superseded", reason=f"a new flow run started attempt {attempt}")
    reg.unset("suspect")
    reg.unset("closing_since")
    # which backend made the run's cluster, from what (``spec``), where it answers and who owns it (``mode``)
    recorded = cluster_record(cfg, cluster)
    config = json.loads(cfg.model_dump_json())
    lifecycle.move(reg, "submitted")
    reg.set(config=config, dataset_id=dataset_id, cluster=recorded)
    if inputs is not None:
        reg.inputs = inputs
    if trials is not None:  # a search: its trials are runs of their own
        reg.set(kind="search", trials=trials)
    reg.attempts.append(_new_attempt(cfg, attempt, started_by, resume_from, flow_run_id))
    # a run whose backend leaves something behind if it ends without its ``down``: the janitor's, once it is over
    assert recorded.backend is not None, "a backend's record() names it (control/backends/base.py: record)"
    if index := backend_class(recorded.backend).janitor_index(cfg.storage):
        _mark(index, cfg.name, True)
    save(cfg.storage, cfg.name, reg)
    return attempt


def _record_to_begin(cfg: Config, started_by: str) -> RunRecord:
    """The record a new attempt goes into (a new one for a new run); RunBusy for a flow while one is in flight."""
    if cfg.is_template:  # a flow resolves the name after staging; a template must never name a run folder
        raise ValueError(f"run name template {cfg.name!r} was not resolved before the attempt was recorded")
    reg = load(cfg.storage, cfg.name)
    if reg is None:
        reg = RunRecord(name=cfg.name, created_at=time.time(), attempts=[], incidents=[], restarts=0)
    if started_by != "watchdog":
        _refuse_if_busy(cfg, reg)
    return reg


def _new_attempt(
    cfg: Config, attempt: int, started_by: str, resume_from: str | None, flow_run_id: str | None
) -> Attempt:
    """Attempt ``attempt`` as it is recorded when submitted: its Ray job's submission id, who started it and why."""
    return Attempt(
        attempt=attempt,
        submission_id=submission_id(cfg.storage, cfg.name, attempt),
        started_at=time.time(),
        started_by=started_by,
        resume_from=resume_from,
        status="SUBMITTED",
        **({"flow_run_id": flow_run_id} if flow_run_id else {}),
    )


def _refuse_if_busy(cfg: Config, reg: RunRecord) -> None:
    """RunBusy when an attempt of the run may still train (submitted or running, not ended)."""
    if not reg.attempts or reg.state not in ("submitted", "running"):
        return
    current = reg.current
    if current.in_flight:
        raise RunBusy(
            f"run {cfg.name!r} is {reg.state}: attempt {current.attempt} (Ray job {current.submission_id}) "
            "is in flight and the watchdog looks after it; wait for it to end, or give this run another name"
        )


def adopt(cfg: Config, attempt: int, message: str) -> RunRecord | None:
    """The flow that watched ``attempt`` is gone while its job may still train: the watchdog looks after it from
    now on (and closes what the flow would have, like a local head). Nothing changes unless ``attempt`` is still the
    run's current attempt in flight: a hook never adopts another flow run's attempt."""
    with leases.acquire_wait(cfg.storage, cfg.name):
        reg = load(cfg.storage, cfg.name)
        if reg is None or len(reg.attempts) != attempt or not reg.current.in_flight:
            return None
        reg.current.set(adopted_by="watchdog", adopted_at=time.time(), adopted_because=message)
        save(cfg.storage, cfg.name, reg)
        return reg


def attempt_of_flow_run(reg: RunRecord, flow_run_id: str) -> Attempt | None:
    """The attempt this flow run started (its cancel and crash hooks act on it and on nothing else), or None when
    it started none -- a queued duplicate of the run, waiting on the series' slot, never touches the run's job."""
    return next((a for a in reversed(reg.attempts) if a.flow_run_id == flow_run_id), None)


def mark_running(storage: str, run: str, attempt: int) -> bool:
    """The attempt's job is RUNNING (first time seen): ``submitted`` -> ``running``. Skipped while a watchdog
    holds the run (the next poll, or the watchdog itself, does it). True once nothing is left to do: a caller polls
    until then, and takes the lease only when the registry still needs the change (one lease, not one a poll)."""
    reg = load(storage, run)
    if reg is None or not lifecycle.mark_running(reg.deep_copy(), attempt):
        return True
    lease = leases.acquire(storage, run, ttl_s=30)
    if lease is None:
        return False
    with lease:
        reg = load(storage, run)
        if reg is not None and lifecycle.mark_running(reg, attempt):
            save(storage, run, reg)
    return True


def end_attempt(
    cfg: Config,
    attempt: int,
    status: str,
    message: str = "",
    state: State | None = None,
    final_model: str | None = None,
) -> RunRecord | None:
    """Record how the flow's attempt ended; the run state follows (succeeded / failed) unless ``state`` says
    otherwise. Under the run's lease, and only while the attempt is still the run's current, unfinished one: a
    watchdog that got there first (recorded the failure, maybe restarted the run) is never overwritten.
    Returns the new record, or None when the watchdog had already dealt with the attempt. ``final_model``: where a
    succeeded attempt's model is."""
    return _end(cfg, attempt, status, message, state, None, final_model)


def hand_over(cfg: Config, attempt: int, message: str, incident: Incident) -> RunRecord | None:
    """The finetune flow saw its training job fail: record the incident and leave recovery to the watchdog."""
    return _end(cfg, attempt, "FAILED", message, "recovering", incident, None)


def _end(
    cfg: Config,
    attempt: int,
    status: str,
    message: str,
    state: State | None,
    incident: Incident | None,
    final_model: str | None,
) -> RunRecord | None:
    with leases.acquire_wait(cfg.storage, cfg.name):
        reg = load(cfg.storage, cfg.name)
        if reg is None:
            raise FileNotFoundError(Layout(cfg.storage).run_registry(cfg.name))
        entry = reg.attempts[attempt - 1]
        dealt_with = len(reg.attempts) != attempt or not entry.in_flight
        if dealt_with and not status == entry.status == "SUCCEEDED":
            return None
        entry.set(status=status, ended_at=time.time(), message=message)
        lifecycle.move(reg, state or ("succeeded" if status == "SUCCEEDED" else "failed"))
        if reg.state == "succeeded" and reg.closing_since is None:  # to be closed: scored, its cluster released
            reg.closing_since = time.time()
        if reg.state == "failed" and not reg.reason:
            reg.reason = message
        if incident is not None:
            reg.incidents.append(incident)
        if final_model is not None:
            reg.final_model = final_model
        save(cfg.storage, cfg.name, reg)
        return reg


def closed(storage: str, run: str) -> None:
    """The succeeded run is closed (scored in its series, its cluster released): the watchdog no longer looks at it."""
    with leases.acquire_wait(storage, run):
        reg = load(storage, run)
        if reg is not None and reg.closing_since is not None:
            reg.unset("closing_since")
            save(storage, run, reg)
