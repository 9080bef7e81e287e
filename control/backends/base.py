"""What every cluster backend shares: how a run reaches its cluster (:class:`ClusterHandle`), the interface each
backend implements (:class:`Backend`), and the errors its verbs raise. The Ray client plumbing (token auth, the Jobs
API client, keeping secrets out of messages) is control/rayapi.py."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, Required, TypedDict

from control import jobsapi
from control.rayapi import AUTH_MODE_ENV, enable_token_auth, jobs_client, redact
from control.records.run import ClusterRecord, ClusterSpec
from ray_jobs.config import ClusterConfig, Config
from ray_jobs.errors import UserError
from ray_jobs.secrets import MaskedError

if TYPE_CHECKING:
    from control.backends.health import Health

__all__ = [
    "AUTH_MODE_ENV",
    "Backend",
    "ClusterError",
    "ClusterUnreachable",
    "ClusterHandle",
    "ClusterSeen",
    "StopUnverified",
    "enable_token_auth",
    "jobs_client",
    "reachable",
    "redact",
]


JOB_ENV = "UNBROKEN_SUBMISSION"  # in the environment of every process of a job unbroken submits: its submission id


class ClusterError(MaskedError, RuntimeError):
    """The cluster could not be started or reached. Its message is masked (it becomes a flow run's state, an
    incident in the run record): a cluster's address may carry credentials (ray_jobs/secrets.py)."""


class ClusterUnreachable(ClusterError, UserError):
    """The cluster the config names does not answer (a wrong ``cluster.address``, a head that is down)."""


class StopUnverified(ClusterError):
    """The cluster could not say whether the job still runs, so it cannot be known to have stopped."""


@dataclass
class ClusterHandle:
    address: str  # Jobs API URL
    dashboard_url: str
    started_here: bool  # a cluster this run brought up (its backend's ``down`` is owed when the run ends)
    python: str  # interpreter the job entrypoints run with on the cluster
    local: bool = False  # a local head unbroken manages (stopped by its last user); False: any other cluster
    backend: str = "local"  # which backend made it (control/backends/__init__.py)
    spec: ClusterSpec = field(default_factory=dict)  # what made it: the backend's own record (a YAML, a name)
    metrics_url: str = ""  # the head node's Prometheus endpoint, when known (a local head's)

    def to_dict(self) -> ClusterSeen:
        return {
            "address": self.address,
            "dashboard_url": self.dashboard_url,
            "started_here": self.started_here,
            "python": self.python,
            "local": self.local,
            "backend": self.backend,
            "spec": self.spec,
            "metrics_url": self.metrics_url,
        }


class ClusterSeen(TypedDict, total=False):
    """A cluster as whoever records an attempt on it knows it: a handle's ``to_dict()``, or the part of one a caller
    knows (its address at least). What the run record keeps of it is its backend's ``record``."""

    address: Required[str]
    dashboard_url: str
    started_here: bool
    python: str
    local: bool
    backend: str
    spec: ClusterSpec
    metrics_url: str


class StartedAhead(Protocol):
    """A cluster start begun ahead of need (``Backend.begin_up``): ``release`` undoes it if no ``up`` took it over,
    saying what was done (None: taken over, or nothing to undo)."""

    def release(self) -> str | None: ...


class Backend:
    """One way of having a Ray cluster, as a node provider is for Ray's cluster launcher: the finetune flow and the
    watchdog call only these verbs, so bringing a cluster back after it died is the same code whatever made it, and
    what only one backend knows (its config's checks, its repairs, its cleanup) lives in that backend.

    - ``problems(cluster, storage)``: what in its config section cannot work, each naming its field.
    - ``up(run)``: make the cluster exist and answer (create it, start what is missing, or find it already up);
      idempotent: calling it on a healthy cluster changes nothing, on a damaged one repairs what the backend can.
    - ``address()``: its Jobs API URL if it can be found now, else None (nothing is created).
    - ``health(handle)``: its shape and headroom (control/backends/health.py).
    - ``replace_nodes(run)``: a node was lost while the job runs: ask for it back; None when the backend does not.
    - ``elsewhere(cluster)``: why this process cannot act on the recorded cluster at all (a local head on another
      host), or None.
    - ``stop_unreachable(handle, run, sid)``: the cluster stopped answering, every other channel agrees its job is
      gone or stuck, and the job must be known stopped; destructive only on the backend's own evidence.
    - ``stop_job(handle, sid)``: the Jobs API says the job ended but its processes still write its heartbeat: end
      them where the backend can reach them (None where it cannot).
    - ``down(handle, run)``: this run is done with it; the backend removes what it created, unless kept.
    - ``record(cluster)`` / ``handle_from_record(record)``: the run record's ``cluster`` and back.
    - ``janitor_index(storage)`` / ``janitor(is_over)``: what is left of runs that ended without their ``down``.
    """

    name: ClassVar[str] = ""
    # Who owns its clusters, as the run record says (``cluster.mode``): ``local`` (a head on this machine shared by
    # runs), ``existing`` (someone else's), ``managed`` (one unbroken brought up).
    mode: ClassVar[str] = "managed"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @classmethod
    def problems(cls, cluster: ClusterConfig, storage: str) -> list[str]:
        """What about ``cluster`` this backend cannot work with, each naming its field (none by default). A class
        method: it runs while the config is loaded, before there is a valid config to make a backend of."""
        return []

    def spec(self) -> ClusterSpec:
        """What this backend makes its cluster from (recorded with the run, so a restart makes the same one)."""
        return {}

    def up(self, run: str | None = None) -> ClusterHandle:
        raise NotImplementedError

    def preflight(self) -> None:
        """Refuse, before any other work, a cluster this run must not use (a ConfigError naming the fields); nothing
        by default. The CLI asks this first, so a refusal is one line, not a failed flow run."""

    def begin_up(self, run: str | None = None) -> StartedAhead | None:
        """Start bringing the cluster up in the background, in this process, for a later ``up`` to take over; an
        object whose ``release()`` undoes it if no ``up`` did, or None when the backend starts nothing ahead."""
        return None

    def announce(self, handle: ClusterHandle) -> str:
        """The line ``provision`` logs once ``up`` returned."""
        verb = "brought up" if handle.started_here else "using"
        return f"{verb} Ray cluster (backend {self.name}) at {handle.address}"

    def address(self) -> str | None:
        raise NotImplementedError

    def health(self, handle: ClusterHandle) -> Health:
        from control.backends import health

        return health.read(handle.address)

    def replace_nodes(self, run: str) -> str | None:
        """Ask for lost worker nodes back without touching the running job; what was done, or None when this backend
        has no such repair (the default: the cluster is not unbroken's to change, or repairs itself)."""
        return None

    @classmethod
    def elsewhere(cls, cluster: ClusterRecord) -> str | None:
        """Why this process cannot act on the cluster the run record names (``cluster``: its ClusterRecord) -- it can
        neither see it nor stop anything of it from here -- or None (the default: a cluster reached by its URL)."""
        return None

    def stop_unreachable(self, handle: ClusterHandle, run: str, submission_id: str) -> str:
        """The cluster does not answer and the job's heartbeat agrees it is gone or stuck; before another job is
        submitted it must be known stopped: take down what ends it for certain -- destructively only when the
        backend's own view (the processes on this host, the launcher's head, the Kubernetes API) confirms the
        cluster dead, never on the Jobs API's silence alone -- and say what was done. By default nothing can be:
        StopUnverified (a failed restart, counted and backed off)."""
        raise StopUnverified(
            f"the Ray cluster at {handle.address} does not answer, and is not unbroken's to take "
            "down: its job may still run"
        )

    def job_gone(self, handle: ClusterHandle, submission_id: str) -> bool | None:
        """The backend's own evidence that no process of the job is left (its driver gone: Ray ends the workers
        that depend on it), so nothing of it can write its heartbeat again; None where it cannot see."""
        return None

    def stop_job(self, handle: ClusterHandle, submission_id: str) -> str | None:
        """The Jobs API says the job ended, yet its processes still write its heartbeat (a driver orphaned by its
        wrapper's death): end them where this backend can reach them; what was done, or None where it cannot."""
        return None

    @classmethod
    def leave_up(cls, cfg: Config, handle: ClusterHandle) -> str | None:
        """Why a run that is done with its cluster leaves it up without calling ``down`` (None: ``down`` is owed).
        A cluster goes only when this run brought it up and did not ask to keep it."""
        if cfg.cluster.keep_running:
            return "cluster.keep_running"
        return None if handle.started_here else "this run did not bring it up"

    def down(self, handle: ClusterHandle, run: str | None = None) -> str:
        raise NotImplementedError

    @classmethod
    def record(cls, cluster: ClusterSeen) -> ClusterRecord:
        """What the run record keeps of its cluster (``cluster``: a handle's dict, or the part of one a caller
        knows): where it answers, which backend made it from what, who owns it, whether its release is owed."""
        return ClusterRecord(
            address=cluster["address"],
            backend=cls.name,
            spec=cluster.get("spec") or {},
            mode=cls.mode,
            # A cluster whose release is owed by whoever finishes the run (unless cluster.keep_running).
            started_here=bool(cluster.get("started_here")),
        )

    @classmethod
    def handle_from_record(cls, record: ClusterRecord) -> ClusterHandle:
        """The run's cluster as its record has it (the interpreter is the config's business, not the record's)."""
        return ClusterHandle(
            record.address,
            record.address,
            record.started_here,
            "",
            local=cls.mode == "local",
            backend=cls.name,
            spec=record.spec,
        )

    @classmethod
    def janitor_index(cls, storage: str) -> str | None:
        """The folder of markers naming the runs whose clusters this backend's janitor looks after once they are
        over (one listing per pass); None when it leaves nothing behind that a janitor must clean."""
        return None

    def janitor_scope(self) -> Hashable:
        """Where this backend's janitor looks (one pass per place, however many runs used it)."""
        return None

    def janitor(self, is_over: Callable[[str, str], bool]) -> list[str]:
        """Remove what unbroken made there whose run ``is_over(storage, run)``; what was removed, for the log."""
        return []

    def _handle(self, address: str, started_here: bool) -> ClusterHandle:
        return ClusterHandle(address, address, started_here, self.cfg.cluster.python, False, self.name, self.spec())


def ray_cli() -> str:
    """The ``ray`` executable beside this interpreter (so a venv's Ray runs the local head)."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def reachable(address: str) -> str | None:
    """None when the Jobs API answers an authenticated request (within a timeout), else why not."""
    why = jobsapi.unanswered(address)
    return None if why is None else redact(why)
