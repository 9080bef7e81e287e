"""What every cluster backend shares: how a run reaches its cluster (:class:`ClusterHandle`), the interface each
backend implements (:class:`Backend`: ``up``, ``address``, ``health``, ``down``), and the Ray client plumbing (token
auth, the Jobs API client, keeping secrets out of messages)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ray_jobs.config import Config

AUTH_MODE_ENV = "RAY_AUTH_MODE"


class ClusterError(RuntimeError):
    """The cluster could not be started or reached."""


@dataclass
class ClusterHandle:
    address: str  # Jobs API URL
    dashboard_url: str
    started_here: bool  # a cluster this run brought up (its backend's ``down`` is owed when the run ends)
    python: str  # interpreter the job entrypoints run with on the cluster
    local: bool = False  # a local head unbroken manages (stopped by its last user); False: any other cluster
    backend: str = "local"  # which backend made it (unbroken/backends/__init__.py)
    spec: dict[str, Any] = field(default_factory=dict)  # what made it: the backend's own record (a YAML, a name)

    def to_dict(self) -> dict:
        return asdict(self)


class Backend:
    """One way of having a Ray cluster. The finetune flow and the watchdog call only these four, so bringing a
    cluster back after it died is the same code whatever made it.

    - ``up(run)``: make the cluster exist and answer (create it, start what is missing, or find it already up);
      idempotent: calling it on a healthy cluster changes nothing, on a damaged one repairs what the backend can.
    - ``address()``: its Jobs API URL if it can be found now, else None (nothing is created).
    - ``health(handle)``: its shape and headroom (unbroken/backends/health.py).
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
        from unbroken.backends import health

        return health.read(handle.address)

    def down(self, handle: ClusterHandle, run: str | None = None) -> None:
        raise NotImplementedError

    def _handle(self, address: str, started_here: bool) -> ClusterHandle:
        return ClusterHandle(address, address, started_here, self.cfg.cluster.python, False, self.name, self.spec())


def ray_cli() -> str:
    """The ``ray`` executable beside this interpreter (so a venv's Ray runs the local head)."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def enable_token_auth() -> None:
    """Clients of a token-auth cluster need RAY_AUTH_MODE=token; an explicit setting by the user wins.

    Ray's C++ config reads the variable when Ray is imported, so if Ray was imported already it is re-read.
    """
    if AUTH_MODE_ENV in os.environ:
        return
    os.environ[AUTH_MODE_ENV] = "token"
    if "ray" in sys.modules:
        from ray._raylet import Config

        Config.initialize("")


def jobs_client(address: str):
    enable_token_auth()
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def reachable(address: str) -> str | None:
    """None when the Jobs API answers an authenticated request (within a timeout), else why not."""
    from tasks import jobsapi  # lazily: the watchers' reader imports this module

    why = jobsapi.unanswered(address)
    return None if why is None else redact(why)


# -- secrets --------------------------------------------------------------------------------------------------
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)


def _secrets() -> list[str]:
    """Values that must never appear in a message: the Ray auth token, and secret-looking variables' values."""
    values = [v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 8]
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    with contextlib.suppress(OSError):
        values.append(token_file.read_text().strip())
    return sorted({v for v in values if len(v) >= 8}, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every secret value masked."""
    for value in _secrets():
        text = text.replace(value, "***")
    return text
