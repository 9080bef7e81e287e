"""Provision the Ray cluster: start a local head (token auth on) or check an existing cluster's Jobs API."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config
from tasks.logs import run_logger

AUTH_MODE_ENV = "RAY_AUTH_MODE"


class ClusterError(RuntimeError):
    """The cluster could not be started or reached."""


@dataclass
class ClusterHandle:
    address: str  # Jobs API URL
    dashboard_url: str
    started_here: bool  # a local head this flow started (and so may stop)
    python: str  # interpreter the job entrypoints run with on the cluster

    def to_dict(self) -> dict:
        return asdict(self)


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


def _reachable(address: str) -> str | None:
    """None when the Jobs API answers (authenticated), else why not."""
    try:
        jobs_client(address).list_jobs()
        return None
    except Exception as e:  # connection refused, 401, auth token missing ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env[AUTH_MODE_ENV] = env.get(AUTH_MODE_ENV, "token")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def start_local_head(cfg: Config, wait_s: float = 90.0) -> ClusterHandle:
    """``ray start --head`` on 127.0.0.1 with token auth (a token is generated if none exists)."""
    address = f"http://127.0.0.1:{cfg.cluster.dashboard_port}"
    handle = ClusterHandle(address, address, False, sys.executable)
    if _reachable(address) is None:
        return handle  # a local head is already up (e.g. kept from an earlier run): use it, don't own it
    env = _ray_env()
    if env[AUTH_MODE_ENV] == "token":
        _run([ray_cli(), "get-auth-token", "--generate"], env, "generate the Ray auth token")
    cmd = [
        ray_cli(), "start", "--head",
        f"--port={cfg.cluster.head_port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={cfg.cluster.dashboard_port}",
        "--disable-usage-stats",
    ]  # fmt: skip
    _run(cmd, env, "start a local Ray head")
    handle.started_here = True
    deadline = time.monotonic() + wait_s
    while (why := _reachable(address)) is not None:
        if time.monotonic() > deadline:
            raise ClusterError(f"local Ray head started but its Jobs API at {address} never answered: {why}")
        time.sleep(1.0)
    return handle


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ClusterError(f"could not {what} (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def stop_local_head() -> None:
    subprocess.run([ray_cli(), "stop"], env=_ray_env(), capture_output=True, text=True)


@task(name="provision-cluster", cache_policy=NO_CACHE)
def provision_cluster(cfg: Config) -> ClusterHandle:
    """Start a local Ray head, or check that ``cluster.address`` answers; returns how to reach it."""
    log = run_logger()
    if cfg.cluster.address:
        why = _reachable(cfg.cluster.address)
        if why:
            raise ClusterError(f"cluster.address {cfg.cluster.address} is not reachable: {why}")
        log.info("using existing Ray cluster at %s", cfg.cluster.address)
        return ClusterHandle(cfg.cluster.address, cfg.cluster.address, False, "python")
    handle = start_local_head(cfg)
    verb = "started" if handle.started_here else "reusing already running"
    log.info("%s local Ray head; dashboard: %s", verb, handle.dashboard_url)
    return handle


@task(name="stop-cluster", cache_policy=NO_CACHE)
def stop_cluster(handle: ClusterHandle) -> None:
    """Stop a local head this flow started (never a cluster it merely used)."""
    if handle.started_here:
        stop_local_head()
        run_logger().info("stopped the local Ray head")
