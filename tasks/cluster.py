"""Provision the Ray cluster: start a local head (token auth on) or check an existing cluster's Jobs API."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config
from ray_jobs.storage import exclusive_lock
from tasks.logs import run_logger

AUTH_MODE_ENV = "RAY_AUTH_MODE"


class ClusterError(RuntimeError):
    """The cluster could not be started or reached."""


@dataclass
class ClusterHandle:
    address: str  # Jobs API URL
    dashboard_url: str
    started_here: bool  # a local head this flow started
    python: str  # interpreter the job entrypoints run with on the cluster
    local: bool = False  # a local head unbroken manages (stopped by its last user); False: an existing cluster

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
    """None when the Jobs API answers an authenticated request (within a timeout), else why not."""
    from tasks import jobsapi

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


# -- a local head of our own ----------------------------------------------------------------------------------
# Each local head unbroken starts has its own Ray temp dir, named by its dashboard port (a short path: Ray's unix
# sockets live under it, and a socket path must stay under 107 bytes). Its processes are found through it, so
# stopping the head stops exactly those -- never ``ray stop``, which kills every Ray process on the machine.
HEADS_DIR = Path(os.environ.get("UNBROKEN_HEADS_DIR", "/tmp/unbroken-ray"))
# What any process needs to run; everything else in the flow's environment reaches a head only when listed in
# cluster.env_passthrough.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
            "SHELL", "TERM", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "XDG_CACHE_HOME",
            "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")  # fmt: skip
BASE_PREFIXES = ("RAY_", "LC_", "NCCL_")
KEPT = "kept"  # marker file: a run asked for cluster.keep_running
USER_FRESH_S = 600.0  # a user file this young counts as live (its run may still be staging)


def head_dir(dashboard_port: int) -> Path:
    return HEADS_DIR / str(dashboard_port)


def _port_of(address: str) -> int:
    return int(address.rstrip("/").rsplit(":", 1)[1])


def _head_env(cfg: Config) -> dict[str, str]:
    """The allow-listed environment of a local head (and so of every job on it)."""
    keep = set(BASE_ENV) | set(cfg.cluster.env_passthrough)
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(BASE_PREFIXES)}
    env[AUTH_MODE_ENV] = env.get(AUTH_MODE_ENV, "token")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A single-machine cluster: Ray then takes 127.0.0.1 as the node address, and its gRPC servers (GCS, raylet,
    # agents) bind loopback; without it Ray resolves 127.0.0.1 to the machine's address and binds 0.0.0.0.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_command(cfg: Config, temp_dir: Path) -> list[str]:
    c = cfg.cluster
    return [
        ray_cli(), "start", "--head",
        f"--port={c.head_port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={c.dashboard_port}",
        # fixed defaults (52365, 10001) would collide between two heads on one machine
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]  # fmt: skip


def _head_lock(port: int):
    """Two runs provisioning the same local head at once: one starts it, the other then finds it up."""
    return exclusive_lock(HEADS_DIR / f"{port}.lock")


def start_local_head(cfg: Config, wait_s: float = 90.0, run: str | None = None) -> ClusterHandle:
    """``ray start --head`` on 127.0.0.1 with token auth, its own temp dir and an allow-listed environment; a head
    already answering on these ports is used instead (``started_here`` False). Either way ``run`` (the config's
    name by default) is registered as one of the head's users."""
    port = cfg.cluster.dashboard_port
    address = f"http://127.0.0.1:{port}"
    handle = ClusterHandle(address, address, False, sys.executable, local=True)
    with _head_lock(port):
        if _reachable(address) is None:  # already up (kept from an earlier run, or another run's)
            _add_user(port, run or cfg.name, cfg.storage, cfg.cluster.keep_running)
            return handle
        env = _head_env(cfg)
        if env[AUTH_MODE_ENV] == "token":
            _run([ray_cli(), "get-auth-token", "--generate"], env, "generate the Ray auth token")
        temp_dir = head_dir(port)
        shutil.rmtree(temp_dir / "users", ignore_errors=True)  # users of an earlier head on this port are gone
        with contextlib.suppress(OSError):
            (temp_dir / KEPT).unlink()
        _run(_head_command(cfg, temp_dir), env, "start a local Ray head")
        _add_user(port, run or cfg.name, cfg.storage, cfg.cluster.keep_running)
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
        raise ClusterError(redact(f"could not {what} (exit {proc.returncode}): {' '.join(cmd)}\n{tail}"))


# -- its users ------------------------------------------------------------------------------------------------
def _add_user(port: int, run: str, storage: str, keep: bool = False) -> None:
    if keep:  # cluster.keep_running: no run stops this head; a person (or stop_local_head) does
        (head_dir(port) / KEPT).touch()
    users = head_dir(port) / "users"
    users.mkdir(parents=True, exist_ok=True)
    body = {"run": run, "storage": storage, "pid": os.getpid(), "host": socket.gethostname(), "at": time.time()}
    (users / f"{run}.json").write_text(json.dumps(body))


def head_users(port: int, ignore: str | None = None) -> list[str]:
    """Runs that still use the local head on ``port``: their process lives, they registered lately, or their run
    is active (a job the watchdog looks after)."""
    from tasks import registry

    live = []
    for f in sorted((head_dir(port) / "users").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            user = json.loads(f.read_text())
            if user["run"] == ignore:
                continue
            fresh = time.time() - user["at"] < USER_FRESH_S or _alive(user["pid"])
            reg = None if fresh else registry.load(user["storage"], user["run"])
            if fresh or (reg is not None and reg.get("state") in registry.ACTIVE):
                live.append(user["run"])
    return live


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pid != os.getpid()
    except OSError:
        return False


# -- stopping it ----------------------------------------------------------------------------------------------
def head_pids(port: int) -> list[int]:
    """Every process of the local head on ``port``: those whose command line or open files are under its temp dir
    (Ray's daemons, agents, workers and job drivers all log there), and their descendants."""
    root = str(head_dir(port))
    parents: dict[int, int] = {}
    mine: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if root in (entry / "cmdline").read_bytes().decode(errors="replace") or _has_open_file_under(entry, root):
                mine.add(pid)
    grew = True
    while grew:  # descendants (multiprocessing helpers have no file of the head open)
        new = {pid for pid, ppid in parents.items() if ppid in mine and pid not in mine}
        mine |= new
        grew = bool(new)
    return sorted(mine)


def _has_open_file_under(proc: Path, root: str) -> bool:
    with contextlib.suppress(OSError):
        for fd in (proc / "fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(root):
                    return True
    return False


def stop_local_head(handle_or_port: ClusterHandle | int, grace_s: float = 10.0) -> list[int]:
    """Stop the local head on this port by its own processes (SIGTERM, then SIGKILL after ``grace_s``); returns
    the PIDs it stopped. Nothing else on the machine is touched."""
    port = handle_or_port if isinstance(handle_or_port, int) else _port_of(handle_or_port.address)
    pids = head_pids(port)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal(left, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while [p for p in pids if _running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        shutil.rmtree(head_dir(port) / "users")
    with contextlib.suppress(OSError):
        (head_dir(port) / KEPT).unlink()
    return pids


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child of ours waits for its parent to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


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
def stop_cluster(handle: ClusterHandle, run: str | None = None) -> None:
    """This run is done with its local head: stop the head if unbroken started it and no other run uses it (an
    existing cluster, or a head someone else started, is never stopped)."""
    if not handle.local:
        return
    log = run_logger()
    port = _port_of(handle.address)
    if run is not None:
        with contextlib.suppress(OSError):
            (head_dir(port) / "users" / f"{run}.json").unlink()
    if (head_dir(port) / KEPT).exists():
        log.info("leaving the local Ray head up (a run asked for cluster.keep_running)")
        return
    others = head_users(port, ignore=run)
    if others:
        log.info("leaving the local Ray head up: still used by %s", ", ".join(others))
        return
    if stop_local_head(port):
        log.info("stopped the local Ray head (its own processes only)")
