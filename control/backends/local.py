"""Backend ``local``: a Ray head on this machine that unbroken starts (token auth on, its own temp dir and ports),
shared by the runs that use it and stopped by the last of them -- by its own processes, never ``ray stop``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from control.backends.base import (
    AUTH_MODE_ENV,
    Backend,
    ClusterError,
    ClusterHandle,
    StopUnverified,
    ray_cli,
    reachable,
    redact,
)
from control.backends.head_users import add_user, forget_users, head_users, kept, user_file
from control.backends.localhost import (
    check_identity,
    elsewhere,
    head_dir,
    head_pids,
    head_processes,
    host_identity,
    job_processes,
    record_identity,
    terminate,
)
from control.rayapi import get as api_get
from ray_jobs.config import Config
from ray_jobs.poll import poll_until
from ray_jobs.storage import exclusive_lock

if TYPE_CHECKING:
    from control.backends.base import ClusterSeen
    from control.records.run import ClusterRecord, ClusterSpec

__all__ = ["LocalHead", "head_dir", "head_pids", "head_processes", "start_local_head", "stop_local_head"]

# -- a local head of our own ----------------------------------------------------------------------------------
# What any process needs to run; everything else in the flow's environment reaches a head only when listed in
# cluster.env_passthrough.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
            "SHELL", "TERM", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "XDG_CACHE_HOME",
            "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")  # fmt: skip
BASE_PREFIXES = ("RAY_", "LC_", "NCCL_")
METRICS_PORT = "metrics-port"  # the head's Prometheus port, as it was started (cluster.metrics_port, or a free one)
DAEMON_LOG_LEVEL = (
    "RAY_LOGGER_LEVEL"  # the level of Ray's Python daemons (dashboard, agents) and a driver's "ray" logger
)
JOB_STOP_GRACE_S = 10.0  # a job's processes get this long after SIGTERM (a worker checkpoints on it)


def _port_of(address: str) -> int:
    return int(address.rstrip("/").rsplit(":", 1)[1])


def _head_env(cfg: Config) -> dict[str, str]:
    """The allow-listed environment of a local head (and so of every job on it)."""
    keep = set(BASE_ENV) | set(cfg.cluster.env_passthrough)
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(BASE_PREFIXES)}
    env[AUTH_MODE_ENV] = env.get(AUTH_MODE_ENV, "token")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's own daemons log at warning (unless set): the runtime env agent logs every runtime_env it sets up whole at
    # info, a job's UNBROKEN_CREDENTIALS among its variables (ray_jobs/secrets.py). Jobs log as Ray's default
    # (control/jobs.py sets it back to info in their runtime_env).
    env.setdefault(DAEMON_LOG_LEVEL, "warning")
    # A single-machine cluster: Ray then takes 127.0.0.1 as the node address, and its gRPC servers (GCS, raylet,
    # agents) bind loopback; without it Ray resolves 127.0.0.1 to the machine's address and binds 0.0.0.0.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # A process of this head that asks Ray's state or job API without an address (Ray Train's placement group
    # cleaner does) finds its own head's dashboard, not "multiple active Ray instances" when another head runs on
    # this machine. Without it the cleaner's thread dies, a Tune trial's placement group outlives its trial, and
    # the search's next trial waits forever for the CPUs it holds.
    env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{cfg.cluster.dashboard_port}"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_command(cfg: Config, temp_dir: Path, metrics_port: int) -> list[str]:
    c = cfg.cluster
    return [
        ray_cli(),
        "start",
        "--head",
        f"--port={c.head_port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={c.dashboard_port}",
        # fixed defaults (52365, 10001) would collide between two heads on one machine
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
        f"--metrics-export-port={metrics_port}",  # Ray's metrics and the jobs' (ray_unbroken_*) for Prometheus
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]


def _head_lock(port: int) -> contextlib.AbstractContextManager[None]:
    """Two runs provisioning the same local head at once: one starts it, the other then finds it up."""
    return exclusive_lock(head_dir(port).with_name(f"{port}.lock"))


def start_local_head(cfg: Config, wait_s: float = 90.0, run: str | None = None) -> ClusterHandle:
    """``ray start --head`` on 127.0.0.1 with token auth, its own temp dir and an allow-listed environment; a head
    already answering on these ports is used instead (``started_here`` False) -- if unbroken started it with what
    this run would (its interpreter, checkout and environment allow-list: HeadMismatch, a config error naming the
    ports, otherwise). Either way ``run`` (the config's name by default) is registered as one of the head's users."""
    port = cfg.cluster.dashboard_port
    address = f"http://127.0.0.1:{port}"
    handle = ClusterHandle(address, address, False, sys.executable, local=True)
    with _head_lock(port):
        if reachable(address) is None:  # already up (kept from an earlier run, or another run's): ours to share?
            check_identity(cfg, session_name(address))
            add_user(port, run or cfg.name, cfg.storage, cfg.cluster.keep_running)
            handle.metrics_url = metrics_url(port)
            return handle
        env = _head_env(cfg)
        if env[AUTH_MODE_ENV] == "token":
            _run([ray_cli(), "get-auth-token", "--generate"], env, "generate the Ray auth token")
        temp_dir = head_dir(port)
        forget_users(port)  # users of an earlier head on this port are gone
        with contextlib.suppress(OSError):
            (temp_dir / "identity.json").unlink()
        metrics_port = cfg.cluster.metrics_port or _free_port()
        _run(_head_command(cfg, temp_dir, metrics_port), env, "start a local Ray head")
        (temp_dir / METRICS_PORT).write_text(str(metrics_port))
        handle.metrics_url = metrics_url(port)
        add_user(port, run or cfg.name, cfg.storage, cfg.cluster.keep_running)
        handle.started_here = True
        if not poll_until(lambda: reachable(address) is None, wait_s):
            why = reachable(address)
            raise ClusterError(f"local Ray head started but its Jobs API at {address} never answered: {why}")
        record_identity(cfg, session_name(address))
    return handle


def session_name(address: str) -> str | None:
    """The Ray session of the head answering at ``address`` (its ``/api/version``), or None when it does not say."""
    r, _ = api_get(address, "/api/version", 10.0)
    if r is None or r.status_code != 200:
        return None
    with contextlib.suppress(ValueError, AttributeError):
        return r.json().get("session_name")
    return None


def check_head(cfg: Config) -> None:
    """Before a run starts a cluster: HeadMismatch when a head it did not start for runs like this answers on its
    ports (``unbroken run`` asks this first, so the refusal is one line before any other work)."""
    address = f"http://127.0.0.1:{cfg.cluster.dashboard_port}"
    if reachable(address) is None:
        check_identity(cfg, session_name(address))


def metrics_url(dashboard_port: int) -> str:
    """The Prometheus endpoint of the local head on ``dashboard_port`` ("" for a head started without one known)."""
    try:
        return f"http://127.0.0.1:{int((head_dir(dashboard_port) / METRICS_PORT).read_text())}/metrics"
    except (OSError, ValueError):
        return ""


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ClusterError(redact(f"could not {what} (exit {proc.returncode}): {' '.join(cmd)}\n{tail}"))


# -- stopping it ----------------------------------------------------------------------------------------------
# Detached actors Ray Train starts from a job's driver (so they carry its environment) and keeps for the cluster
# after the job ends: Ray Data's autoscaling coordinator (seen here alive 20 s after its job's driver was killed).
DETACHED_HELPERS = ("ray::_AutoscalingCoordinatorActor",)


def _detached_helper(p: psutil.Process) -> bool:
    try:
        return " ".join(p.cmdline()).strip().startswith(DETACHED_HELPERS)
    except psutil.Error:
        return True  # gone meanwhile


def _is_raylet(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return p.name() == "raylet"
    return False


def stop_local_head(handle_or_port: ClusterHandle | int, grace_s: float = 10.0) -> list[int]:
    """Stop the local head on this port by its own processes; returns the PIDs it stopped. Nothing else on the
    machine is touched.

    The raylet goes first, as in ``ray stop``: SIGTERM and up to ``grace_s`` to end its workers and drivers (a
    training worker checkpoints on SIGTERM). The head's other daemons (GCS, dashboard, agents) then get SIGKILL: they
    keep nothing a stopped head needs, and on SIGTERM each takes seconds to say goodbye to the others (sent to every
    process at once, the raylet waited its whole timeout for a GCS already gone: ~10 s a stop)."""
    port = handle_or_port if isinstance(handle_or_port, int) else _port_of(handle_or_port.address)
    procs = head_processes(port)
    terminate([p for p in procs if _is_raylet(p)], grace_s)
    terminate(procs, 0.0)
    forget_users(port)
    return [p.pid for p in procs]


# -- started ahead of need ------------------------------------------------------------------------------------
# A start begun early in this process (``LocalHead.begin_up``: the CLI, while Prefect's temporary server boots), by
# dashboard port; the first ``up`` for that port takes it over instead of starting the head itself.
_EARLY: dict[int, tuple[Future[ClusterHandle], str]] = {}


class EarlyStart:
    """A local head coming up in the background for a run; ``release`` stops it if no ``up`` took it over (the run
    ended before it needed a cluster), as the run's own ``down`` would."""

    def __init__(self, backend: LocalHead, future: Future[ClusterHandle], run: str) -> None:
        self.backend, self.future, self.run = backend, future, run

    def release(self) -> str | None:
        port = self.backend.cfg.cluster.dashboard_port
        if _EARLY.get(port, (None,))[0] is not self.future:
            return None  # taken over: the run releases it
        _EARLY.pop(port, None)
        try:
            handle = self.future.result()
        except Exception:  # it never came up; whatever half started is its own next start's to clean
            return None
        return self.backend.down(handle, self.run)


class LocalHead(Backend):
    name = "local"
    mode = "local"

    def spec(self) -> ClusterSpec:
        c = self.cfg.cluster
        return {"head_port": c.head_port, "dashboard_port": c.dashboard_port, "host": host_identity()}

    @classmethod
    def elsewhere(cls, cluster: ClusterRecord) -> str | None:
        return elsewhere(cluster.spec or {})

    @classmethod
    def record(cls, cluster: ClusterSeen) -> ClusterRecord:
        """A local head is recorded by the process on its host (the flow that started it or found it, a watchdog
        that brought it back): that is where it runs."""
        rec = super().record(cluster)
        rec.spec = {**rec.spec, "host": rec.spec.get("host") or host_identity()}
        return rec

    def preflight(self) -> None:
        """HeadMismatch when a head this run would not have started answers on its ports."""
        check_head(self.cfg)

    def begin_up(self, run: str | None = None) -> EarlyStart | None:
        """Start the head in a background thread of this process, for ``up`` to take over (None if one is already
        on its way here)."""
        port, run = self.cfg.cluster.dashboard_port, run or self.cfg.name
        if port in _EARLY:
            return None
        pool = ThreadPoolExecutor(1, thread_name_prefix="local-head")
        future = pool.submit(start_local_head, self.cfg, run=run)
        pool.shutdown(wait=False)
        _EARLY[port] = (future, run)
        return EarlyStart(self, future, run)

    def up(self, run: str | None = None) -> ClusterHandle:
        early = _EARLY.pop(self.cfg.cluster.dashboard_port, None)
        if early is not None:
            future, started_for = early
            handle = future.result()
            if (run or self.cfg.name) != started_for:
                add_user(
                    _port_of(handle.address), run or self.cfg.name, self.cfg.storage, self.cfg.cluster.keep_running
                )
        else:
            handle = start_local_head(self.cfg, run=run)
        handle.spec = self.spec()
        return handle

    def announce(self, handle: ClusterHandle) -> str:
        verb = "started" if handle.started_here else "reusing already running"
        metrics = f"; metrics: {handle.metrics_url}" if handle.metrics_url else ""
        return f"{verb} local Ray head; dashboard: {handle.dashboard_url}{metrics}"

    def address(self) -> str | None:
        address = f"http://127.0.0.1:{self.cfg.cluster.dashboard_port}"
        return address if reachable(address) is None else None

    def stop_unreachable(self, handle: ClusterHandle, run: str, submission_id: str) -> str:
        """A head of ours that does not answer, on this host: gone already (none of its processes left), or its
        processes are stopped -- all of them when no other run uses it (a head wedged for good cannot come back
        otherwise), only this job's when other runs (or a ``keep_running``) still count on it."""
        if why := elsewhere(handle.spec):
            raise StopUnverified(why)
        port = _port_of(handle.address)
        if not head_processes(port):
            return "the local Ray head is gone: none of its processes is left on this host"
        others = head_users(port, ignore=(run, self.cfg.storage))
        if not others and not kept(port):
            stop_local_head(port)
            return "stopped the local Ray head's processes (no other run uses it)"
        procs = job_processes(submission_id)
        terminate(procs, JOB_STOP_GRACE_S)
        users = ", ".join(others) or "cluster.keep_running"
        return f"stopped the {len(procs)} process(es) of Ray job {submission_id}; the head itself is left up ({users})"

    def job_gone(self, handle: ClusterHandle, submission_id: str) -> bool | None:
        """On this host (a local head's drivers run here), no process carries the job's mark but Ray's detached
        helpers, which outlive the job that started them and never run its code; None elsewhere -- and None when a
        Ray process here hides its environment from this user (another user's: an orphaned driver may be among them;
        unknown is not gone)."""
        if elsewhere(handle.spec):
            return None
        unseen: list[int] = []
        left = [p for p in job_processes(submission_id, unseen) if not _detached_helper(p)]
        return None if unseen and not left else not left

    def stop_job(self, handle: ClusterHandle, submission_id: str) -> str | None:
        """The job's processes on this host, by their mark (never the head, never another job): SIGTERM (a worker
        checkpoints on it), then SIGKILL what is left."""
        if elsewhere(handle.spec):
            return None
        procs = job_processes(submission_id)
        if not procs:
            return None
        terminate(procs, JOB_STOP_GRACE_S)
        return f"stopped the {len(procs)} process(es) of Ray job {submission_id} left running after it ended"

    @classmethod
    def leave_up(cls, cfg: Config, handle: ClusterHandle) -> str | None:
        return None  # ``down`` decides: the head's users and keep_running are the head's own record

    def down(self, handle: ClusterHandle, run: str | None = None) -> str:
        """This run no longer uses the head; it stops when no other run does (and none asked to keep it). Returns
        what happened, for the log."""
        port = _port_of(handle.address)
        mine = None if run is None else (run, self.cfg.storage)
        if mine is not None:
            with contextlib.suppress(OSError):
                user_file(port, *mine).unlink()
        if kept(port):
            return "leaving the local Ray head up (a run asked for cluster.keep_running)"
        others = head_users(port, ignore=mine)
        if others:
            return f"leaving the local Ray head up: still used by {', '.join(others)}"
        if stop_local_head(port):
            return "stopped the local Ray head (its own processes only)"
        return "the local Ray head was already stopped"


BACKEND = LocalHead
