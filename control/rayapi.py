"""Talking to a Ray cluster's dashboard over HTTP, the plumbing under the Jobs API reader (control/jobsapi.py), the
health reader and the backends: token auth, authenticated GETs with a timeout, the SDK's Jobs API client, and keeping
secrets out of every message."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from ray_jobs.ray_private import auth_headers, reload_ray_config
from ray_jobs.secrets import mask

if TYPE_CHECKING:  # imported when first used: flows import this module without Ray
    import requests
    from ray.job_submission import JobSubmissionClient

AUTH_MODE_ENV = "RAY_AUTH_MODE"


def enable_token_auth() -> None:
    """Clients of a token-auth cluster need RAY_AUTH_MODE=token; an explicit setting by the user wins.

    Ray's C++ config reads the variable when Ray is imported, so if Ray was imported already it is re-read.
    """
    if AUTH_MODE_ENV in os.environ:
        return
    os.environ[AUTH_MODE_ENV] = "token"
    if "ray" in sys.modules:
        reload_ray_config()


def jobs_client(address: str) -> JobSubmissionClient:
    enable_token_auth()
    from ray.job_submission import JobSubmissionClient

    # Its submit logs each file of the working_dir it leaves out and each package it uploads, at INFO on the
    # terminal of `unbroken run` (nine lines a submission): what it uploaded is in the job's own log.
    for name in ("ray._private.runtime_env.packaging", "ray.dashboard.modules.dashboard_sdk"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return JobSubmissionClient(address)


def headers() -> dict[str, str]:
    enable_token_auth()
    return auth_headers()


def get(address: str, path: str, timeout_s: float) -> tuple[requests.Response | None, str]:
    """(response, "") or (None, why) when there was no HTTP answer at all."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        hdrs = headers()
    except AuthenticationError:  # token auth on, no token on this machine yet (a fresh one): we cannot ask
        return None, "no Ray auth token here (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
    try:
        return requests.get(address.rstrip("/") + path, headers=hdrs, timeout=timeout_s), ""
    except requests.RequestException as e:
        return None, f"{type(e).__name__}: {first_line(str(e))}"


def first_line(text: str, limit: int = 300) -> str:
    """The first line of ``text``, cut to ``limit`` characters: what a one-line message quotes of an error."""
    return (text.strip().splitlines() or [""])[0][:limit]


def redact(text: str) -> str:
    """``text`` with every secret masked: the Ray auth token, secret-looking variables' values, URI passwords and
    secret query parameters -- the one rule of everything a run writes or shows (ray_jobs/secrets.py)."""
    return mask(text)
