"""The run record ``<storage>/runs/<run>/run.json``, typed: the contract between the finetune flow, the watchdog and
``unbroken status``. State, the config it trains with, dataset, cluster, every attempt and every incident.

Its states and the moves between them are ``control/lifecycle.py``'s table, and only that module changes a record's
``state``. A search's trial (``search`` set) is a run too, but its job is the search's: its state follows the
search's trials; the watchdog looks after the search, never a trial on its own.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, JsonValue

from ray_jobs.config import Config, from_json
from ray_jobs.contracts.base import Part, Record, RecordError
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.secrets import reveal

State = Literal["submitted", "running", "recovering", "succeeded", "failed", "stopped-early"]
STATES: tuple[str, ...] = State.__args__
ACTIVE = ("submitted", "running", "recovering")
# An attempt's job: SUBMITTED/RUNNING while it may train; how it ended otherwise.
AttemptStatus = Literal["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED", "STALLED", "LOST"]
IN_FLIGHT = ("SUBMITTED", "RUNNING")


# What a backend made its cluster from (``Backend.spec``: a YAML's path, a namespace and name, a head's ports and
# host): that backend's own record, read by it alone -- opaque (``object``) to everyone else.
ClusterSpec = dict[str, object]


class ClusterRecord(Part):
    """Where the run's cluster answers and which backend made it from what; what its backend needs to find it
    again (control/backends: ``record`` / ``handle_from_record``)."""

    address: str
    backend: str | None = None  # absent in records written before backends existed: read by ``mode``
    spec: ClusterSpec = Field(default_factory=dict)
    mode: str | None = None  # local | existing | managed: who owns the cluster
    started_here: bool = False  # its release is owed by whoever finishes the run (unless cluster.keep_running)

    def url(self) -> str:
        """The address to send requests to: the recorded one is masked (a dashboard behind basic auth,
        ``https://user:***@ray.example.com``), revealed with this process's ``UNBROKEN_CREDENTIALS``."""
        return reveal(self.address)


class Attempt(Part):
    """One submission of the training job."""

    attempt: int
    submission_id: str
    started_at: float
    started_by: str  # finetune-flow | watchdog
    resume_from: str | None = None
    status: AttemptStatus = "SUBMITTED"
    ended_at: float | None = None
    message: str = ""
    adopted_by: str | None = None  # the watchdog, once the flow that watched the attempt was gone
    adopted_at: float | None = None
    adopted_because: str | None = None
    flow_run_id: str | None = None  # the Prefect flow run that started it (its cancel and crash hooks act on it alone)
    # its earlier drivers' submission ids, each lost while its run host trained on (``submission_id``: the one a
    # driver re-attached under, ray_jobs/host.py)
    drivers: list[str] = Field(default_factory=list)

    @property
    def in_flight(self) -> bool:
        return self.status in IN_FLIGHT


class Incident(Part):
    """Trouble with an attempt, and what was done about it. ``action``: None/``waiting`` (open: to be restarted),
    ``restarted``, ``gave-up``, ``observed`` (an ambiguous sign that did not hold, or channels that disagree: the
    Jobs API silent while the job's heartbeat is fresh -- ``cleared_at`` unset while it lasts), ``noted`` (a health
    finding), ``superseded`` (a new flow run took the run over)."""

    kind: str
    detected_by: str
    detected_at: float
    attempt: int
    action: str | None = None
    detail: str = ""
    error: JobFailure | None = None  # the root cause the job printed
    phase: str | None = None
    failed_step: int | None = None
    progress_steps: int = 0  # what the failed attempt trained: enough of it resets the restart budget
    last_progress_at: float | None = None
    silent_s: float | None = None
    beat_time: float | None = None  # the heartbeat's own ``time`` when the incident opened (did it move since?)
    # confirmation of an ambiguous sign
    confirmed_at: float | None = None
    observations: int | None = None
    held_s: float | None = None
    cleared_at: float | None = None
    # waiting, restarting, giving up
    next_restart_at: float | None = None
    lost_steps: int | None = None
    new_attempt: int | None = None
    submission_id: str | None = None
    resumed_from: str | None = None
    resumed_step: int | None = None
    restarted_at: float | None = None
    reprovisioned: bool | None = None
    first_new_step_at: float | None = None
    time_to_recover_s: float | None = None
    downtime_s: float | None = None
    reason: str | None = None
    gave_up_at: float | None = None
    # restarts tried that could not complete (the old job's end unverifiable, the cluster not provisioned): each
    # counts against the budget and backs off like a restart
    failed_tries: int | None = None
    last_try_at: float | None = None
    last_try_error: str | None = None
    last_seen_at: float | None = None  # an observed disagreement: the last look that still showed it
    repair: str | None = None  # a health finding's repair: what the backend was asked for

    @property
    def open(self) -> bool:
        return self.action in (None, "waiting")

    @property
    def preempted(self) -> bool:
        """A preemption (SIGTERM, a drained node) is the platform's doing, never a failure of the run."""
        error = self.error
        return self.kind == "preempted" or (error is not None and (error.preempted or error.type == "Preempted"))


class Suspect(Part):
    """An ambiguous sign seen but not yet confirmed (it must hold for ``fault_tolerance.confirm_s``)."""

    kind: str
    attempt: int
    first_at: float
    observations: int = 0
    last_at: float | None = None
    detail: str = ""
    beat_time: float | None = None  # the heartbeat's own ``time`` at the first look: a job whose heartbeat moves
    # since is alive, whatever the other channel says


class Shape(Part):
    """The most nodes the current attempt's cluster had alive at any look: what "a node is missing" is judged by."""

    attempt: int
    nodes: int = 0


class RunRecord(Record):
    """``runs/<run>/run.json``. Version 1: the untyped files of earlier releases (same fields, no version); 2: typed;
    3: an attempt's flow run, incidents' heartbeat stamp and failed restarts, a succeeded run's closing; 4: the
    attempt's inputs as one part (``inputs``: ``manifest_url``, ``model_path``, ``score_manifest_url`` and
    ``parent`` were top-level fields), an attempt's earlier drivers -- an older release refuses a newer record by its version, not by a field it
    does not know."""

    SCHEMA: ClassVar[int] = 4

    name: str = ""  # the run folder's name when a record (a test's, a hand-written one) leaves it out
    created_at: float | None = None
    updated_at: float | None = None
    state: State = "submitted"
    config: dict[str, JsonValue] = Field(default_factory=dict)  # as the current attempt was given it (a plain tree:
    # a record outlives the version of the config schema that wrote it)
    dataset_id: str | None = None
    cluster: ClusterRecord | None = None
    attempts: list[Attempt] = Field(default_factory=list)
    incidents: list[Incident] = Field(default_factory=list)
    restarts: int = 0
    reason: str | None = None
    final_model: str | None = None
    # what the current attempt was given: what the watchdog resubmits without the flow (a trial: its search's)
    inputs: AttemptInputs | None = None
    suspect: Suspect | None = None
    shape: Shape | None = None
    # a hyperparameter search (``kind: search``: its trials' run names) and its trials (``search``: whose)
    kind: Literal["run", "search"] = "run"
    trials: list[str] = Field(default_factory=list)
    search: str | None = None
    params: dict[str, JsonValue] | None = None  # a trial's drawn values, field -> value
    # A succeeded run still to be closed (scored in its series, its cluster released): the flow closes it, or the
    # watchdog once the flow has not for a while (a closing that raised, a flow killed meanwhile)
    closing_since: float | None = None

    @classmethod
    def migrate(cls, tree: dict[str, Any]) -> dict[str, Any]:
        if tree.get("schema_version", 1) == 1:  # v1 -> v2: the same fields; a version from now on
            tree["schema_version"] = 2
        if tree["schema_version"] == 2:  # v2 -> v3: new optional fields only
            tree["schema_version"] = 3
        if tree["schema_version"] == 3:  # v3 -> v4: the attempt's inputs gathered into one part
            given = {
                k: tree.pop(k) for k in ("manifest_url", "model_path", "score_manifest_url", "parent") if k in tree
            }
            if given.get("manifest_url") is not None and given.get("model_path") is not None:
                tree["inputs"] = {k: v for k, v in given.items() if v is not None}
            tree["schema_version"] = 4
        return tree

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def watched(self) -> bool:
        """Whether the watchdog looks after this run (active or still to be closed, and not a trial: its search is
        looked after)."""
        return (self.active or self.closing_since is not None) and self.search is None

    @property
    def recorded_cluster(self) -> ClusterRecord:
        """The cluster the current attempt was recorded on (``registry.begin_attempt`` records one with every
        attempt); RecordError for a record without one -- the watchdog leaves such a run alone, named."""
        if self.cluster is None:
            raise RecordError(f"run {self.name}: its record names no cluster, though the watchdog must reach one")
        return self.cluster

    @property
    def current(self) -> Attempt:
        return self.attempts[-1]

    def open_incident(self) -> Incident | None:
        """The incident not acted on yet (no restart, not given up), if any."""
        return next((i for i in self.incidents if i.open), None)

    def cfg(self) -> Config:
        """The typed config the current attempt was given, its credentials revealed from this process's environment
        (``from_json``: the record holds them masked)."""
        return from_json(json.dumps(self.config))

    def deep_copy(self) -> RunRecord:
        """A deep copy (what a pure decision changes, leaving the record it was given as it was). Not named ``copy``:
        that is pydantic's own (deprecated, shallow by default), whose signature this would break."""
        return self.model_copy(deep=True)


def load_record(storage: str, run: str) -> RunRecord | None:
    """The run's record under ``storage`` (migrated from an older version's file), or None when the run has none --
    what the registry loads, and what a backend reads of a run (whether a local head's user is still active)."""
    from ray_jobs.storage import Layout

    reg = RunRecord.read(Layout(storage).run_registry(run))
    if reg is not None and not reg.name:
        reg.name = run
    return reg


def storage_tag(storage: str) -> str:
    """Which storage, in six hex digits: in a Ray job's submission id, a head user's file, a RayCluster's label."""
    import hashlib

    return hashlib.sha256(storage.rstrip("/").encode()).hexdigest()[:6]
