"""What the watchers (the finetune flow's watch, the watchdog) read from Ray's Jobs API, as observations that keep
"the job is dead" apart from "I could not tell".

Why not ``JobSubmissionClient`` alone: its requests have no timeout (a stopped dashboard hangs a watcher for good),
its constructor makes a request of its own, and every failure is the same ``RuntimeError`` -- a 404 for a job the
cluster does not know looks like a 502 from a proxy or a 401 from an auth hiccup. A watcher that cannot tell them
apart restarts healthy jobs. Here each read has a timeout and says which it was: ``ok`` (the API answered with the
job), ``missing`` (the API answered, and has no such job), ``unknown`` (transport error, timeout, 5xx, 401/403:
nothing can be concluded about the job).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from control.rayapi import first_line as _first_line
from control.rayapi import get as _get
from control.rayapi import headers as _headers

TIMEOUT_S = 10.0


@dataclass
class JobView:
    """One read of one job: ``api`` is ok | missing | unknown; status/message only when ok."""

    api: str
    status: str = ""
    message: str = ""
    why: str = ""  # what went wrong when api != ok
    driver_node: str = ""  # the hex id of the node the job's driver runs (ran) on, when the Jobs API says

    @property
    def terminal(self) -> bool:
        return self.status in ("SUCCEEDED", "FAILED", "STOPPED")


def read_job(address: str, submission_id: str, timeout_s: float = TIMEOUT_S) -> JobView:
    """The job's status as the Jobs API reports it, or why that could not be read."""
    r, why = _get(address, f"/api/jobs/{submission_id}", timeout_s)
    if r is None:
        return JobView("unknown", why=why)
    if r.status_code == 200:
        try:
            body = r.json()
            node = str(body.get("driver_node_id") or "")
            return JobView("ok", str(body.get("status", "")), body.get("message") or "", driver_node=node)
        except ValueError:
            return JobView("unknown", why="the Jobs API answered 200 with a body that is not JSON")
    if r.status_code == 404 and api_answers(address, timeout_s):
        return JobView("missing", why=f"the cluster at {address} has no job {submission_id}")
    return JobView("unknown", why=f"HTTP {r.status_code} from the Jobs API: {_first_line(r.text)}")


def api_answers(address: str, timeout_s: float = TIMEOUT_S) -> bool:
    """Whether the Jobs API answers an authenticated request properly (a 404 for a job means something only
    then: a proxy or a half-started dashboard also answers 404)."""
    return unanswered(address, timeout_s) is None


def unanswered(address: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """None when the Jobs API answers an authenticated request properly, else why not."""
    r, why = _get(address, "/api/jobs/", timeout_s)
    if r is None:
        return why
    return None if r.status_code == 200 else f"HTTP {r.status_code} from the Jobs API: {_first_line(r.text)}"


def job_logs(address: str, submission_id: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """The job's log, or None when it cannot be read now."""
    r, _ = _get(address, f"/api/jobs/{submission_id}/logs", timeout_s)
    if r is None or r.status_code != 200:
        return None
    try:
        return r.json().get("logs", "")
    except ValueError:
        return None


def job_env(address: str, submission_id: str, timeout_s: float = TIMEOUT_S) -> dict[str, str] | None:
    """The environment variables the job was submitted with (its runtime_env's ``env_vars``, as the Jobs API reports
    them), or None when they cannot be read now (no answer, no such job, a body without them)."""
    env = _runtime_env_field(address, submission_id, "env_vars", timeout_s)
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else None


def job_user_code(address: str, submission_id: str, timeout_s: float = TIMEOUT_S) -> list[str] | None:
    """The user's code a job was shipped (its runtime_env's ``py_modules`` past the first, unbroken's own: the
    packages' URIs on the cluster), or None when it cannot be read now."""
    modules = _runtime_env_field(address, submission_id, "py_modules", timeout_s)
    return [str(m) for m in modules[1:]] if isinstance(modules, list) else None


def _runtime_env_field(address: str, submission_id: str, field: str, timeout_s: float) -> Any:
    """One field of the runtime_env a job was submitted with, as the Jobs API reports it; None when it cannot be read
    now (no answer, no such job, a body without it)."""
    r, _ = _get(address, f"/api/jobs/{submission_id}", timeout_s)
    if r is None or r.status_code != 200:
        return None
    try:
        return (r.json().get("runtime_env") or {}).get(field)
    except (ValueError, AttributeError):
        return None


def stop_job(address: str, submission_id: str, timeout_s: float = TIMEOUT_S) -> None:
    """Ask Ray to stop the job; the caller verifies with :func:`read_job` that it ended."""
    import requests

    url = f"{address.rstrip('/')}/api/jobs/{submission_id}/stop"
    with contextlib.suppress(requests.RequestException):  # whether it worked is read back, not assumed
        requests.post(url, headers=_headers(), timeout=timeout_s)
