"""What every cluster backend shares: how a run reaches its cluster (:class:`ClusterHandle`), the interface each
backend implements (:class:`Backend`: ``up``, ``address``, ``health``, ``down``). The Ray client plumbing (token
auth, the Jobs API client, keeping secrets out of messages) is control/rayapi.py."""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from control import jobsapi
from control.rayapi import AUTH_MODE_ENV, enable_token_auth, jobs_client, redact
from ray_jobs.config import Config

__all__ = [
    "AUTH_MODE_ENV",
    "Backend",
    "ClusterError",
    "ClusterHandle",
    "enable_token_auth",
    "jobs_client",
    "reachable",
    "redact",
]


class ClusterError(RuntimeError):
    """The cluster could not be started or reached."""


@dataclass
class ClusterHandle:
    address: str  # Jobs API URL
    dashboard_url: str
    started_here: bool  # a cluster this run brought up (its backend's ``down`` is owed when the run ends)
    python: str  # interpreter the job entrypoints run with on the cluster
    local: bool = False  # a local head unbroken manages (stopped by its last user); False: any other cluster
    backend: str = "local"  # which backend made it (control/backends/__init__.py)
    spec: dict[str, Any] = field(default_factory=dict)  # what made it: the backend's own record (a YAML, a name)

    def to_dict(self) -> dict:
        return asdict(self)


class Backend:
    """One way of having a Ray cluster. The finetune flow and the watchdog call only these four, so bringing a
    cluster back after it died is the same code whatever made it.

    - ``up(run)``: make the cluster exist and answer (create it, start what is missing, or find it already up);
      idempotent: calling it on a healthy cluster changes nothing, on a damaged one repairs what the backend can.
    - ``address()``: its Jobs API URL if it can be found now, else None (nothing is created).
    - ``health(handle)``: its shape and headroom (control/backends/health.py).
    - ``down(handle, run)``: this run is done with it; the backend removes what it created, unless kept.
    """

    name = ""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def spec(self) -> dict[str, Any]:
        """What this backend makes its cluster from (recorded with the run, so a restart makes the same one)."""
        return {}

    def up(self, run: str | None = None) -> ClusterHandle:
        raise NotImplementedError

    def begin_up(self, run: str | None = None):
        """Start bringing the cluster up in the background, in this process, for a later ``up`` to take over; an
        object whose ``release()`` undoes it if no ``up`` did, or None when the backend starts nothing ahead."""
        return None

    def address(self) -> str | None:
        raise NotImplementedError

    def health(self, handle: ClusterHandle):
        from control.backends import health

        return health.read(handle.address)

    def down(self, handle: ClusterHandle, run: str | None = None) -> None:
        raise NotImplementedError

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
