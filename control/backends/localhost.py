"""Where a local head runs and whose it is: the host identity a run records of its local head (a watchdog on another
host must never act on it through its own 127.0.0.1), the identity a head unbroken starts records of itself (a run
never submits into a head started from another checkout, interpreter or environment), and the processes of a head
and of one job on it (found by their own marks, so stopping one never touches another run's)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import psutil

from control.backends.base import JOB_ENV
from ray_jobs.config import Config, ConfigError
from ray_jobs.poll import poll_until

if TYPE_CHECKING:
    from control.records.run import ClusterSpec

# Each local head unbroken starts has its own Ray temp dir, named by its dashboard port (a short path: Ray's unix
# sockets live under it, and a socket path must stay under 107 bytes). Its processes are found through it, so
# stopping the head stops exactly those -- never ``ray stop``, which kills every Ray process on the machine.
HEADS_DIR = Path(os.environ.get("UNBROKEN_HEADS_DIR", "/tmp/unbroken-ray"))
IDENTITY = "identity.json"  # in a head's temp dir: what it was started with (head_identity), and its session
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def head_dir(dashboard_port: int) -> Path:
    return HEADS_DIR / str(dashboard_port)


# -- which host ---------------------------------------------------------------------------------------------------
def host_identity() -> dict[str, str]:
    """This machine as a local head's record keeps it: 127.0.0.1 leads to a head only from the same boot and network
    namespace, and its processes can be signalled only from the same PID namespace (several "hosts" on one machine
    are namespaces of it). The hostname is for people."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"hostname": os.uname().nodename, "boot_id": boot, "net_ns": _namespace("net"), "pid_ns": _namespace("pid")}


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def elsewhere(spec: ClusterSpec) -> str | None:
    """Why a local head recorded with ``spec`` cannot be seen or stopped from here (another host, boot or
    namespace), or None. A record from before hosts were recorded is taken as this host's."""
    there = spec.get("host")
    if not isinstance(there, dict):  # absent (a record from before hosts were recorded), or not one of ours
        there = {}
    here = host_identity()
    differ = [k for k in ("boot_id", "net_ns", "pid_ns") if there.get(k) and there[k] != here[k]]
    if not differ:
        return None
    return (
        f"its local Ray head runs on host {there.get('hostname', '?')} ({', '.join(differ)} differ from this "
        f"host {here['hostname']}'s): 127.0.0.1 here does not lead to it, so nothing is judged or stopped from "
        "here -- left to a watchdog on that host"
    )


# -- whose head ---------------------------------------------------------------------------------------------------
class HeadMismatch(ConfigError):
    """A Ray head already answers on the run's ports but was not started for runs like this one."""

    def __init__(self, message: str) -> None:
        self.problems = [message]
        ValueError.__init__(self, message)  # one line, not the config's list


class HeadIdentity(TypedDict):
    """What a local head was started with (``identity.json`` in its temp dir, with its Ray session)."""

    interpreter: str
    project: str
    version: str
    env_passthrough: list[str]
    env_digest: str


def head_identity(cfg: Config) -> HeadIdentity:
    """What a head's jobs inherit from whoever started it: the interpreter (its virtualenv), the project checkout,
    unbroken's version, and the environment allow-list (``cluster.env_passthrough``: the names, and a digest of their
    values -- no value is written)."""
    names = sorted(set(cfg.cluster.env_passthrough))
    values = json.dumps({k: os.environ.get(k) for k in names}, sort_keys=True).encode()
    try:
        version = metadata.version("unbroken")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "interpreter": os.path.realpath(sys.executable),
        "project": str(PROJECT_ROOT),
        "version": version,
        "env_passthrough": names,
        "env_digest": hashlib.sha256(values).hexdigest()[:16],
    }


def record_identity(cfg: Config, session: str | None) -> None:
    """Written by whoever started the head on ``cluster.dashboard_port``, once it answers (``session``: Ray's
    session name, which ties the record to this very head and not to an earlier one on the same port)."""
    path = head_dir(cfg.cluster.dashboard_port) / IDENTITY
    path.write_text(json.dumps({**head_identity(cfg), "session": session}, indent=2, sort_keys=True))


def check_identity(cfg: Config, session: str | None) -> None:
    """HeadMismatch, naming the ports and what differs, unless the head answering on the run's ports (Ray session
    ``session``) was started by unbroken with what this run would start it with."""
    c = cfg.cluster
    ports = f"cluster.dashboard_port={c.dashboard_port}, cluster.head_port={c.head_port}"
    try:
        theirs = json.loads((head_dir(c.dashboard_port) / IDENTITY).read_text())
    except (OSError, ValueError):
        theirs = None
    if theirs is None or (session and theirs.get("session") != session):
        raise HeadMismatch(
            f"{ports}: a Ray head that unbroken did not start answers on these ports; stop it or "
            "give the run other ports"
        )
    ours = head_identity(cfg)
    mine: dict[str, object] = dict(ours)  # read by the names below
    what = {"interpreter": "interpreter", "project": "project checkout", "version": "unbroken version"}
    differ = [
        f"{label} {theirs.get(k)!r} (this run: {mine[k]!r})" for k, label in what.items() if theirs.get(k) != mine[k]
    ]
    theirs_env, ours_env = set(theirs.get("env_passthrough") or []), set(ours["env_passthrough"])
    if theirs_env != ours_env:
        differ.append(
            f"cluster.env_passthrough (only the head's: {sorted(theirs_env - ours_env)}, only this run's: "
            f"{sorted(ours_env - theirs_env)})"
        )
    elif theirs.get("env_digest") != ours["env_digest"]:
        differ.append("values of cluster.env_passthrough (credentials, endpoints)")
    if differ:
        raise HeadMismatch(
            f"{ports}: the Ray head on these ports was started with another {'; '.join(differ)} -- "
            "its jobs would run with that; stop it (or let its runs end) or give this run other "
            "ports"
        )


# -- its processes ------------------------------------------------------------------------------------------------
def head_processes(port: int) -> list[psutil.Process]:
    """Every process of the local head on ``port``: those whose command line or open files are under its temp dir
    (Ray's daemons, agents, workers and job drivers all log there), and their descendants. psutil's handles refuse to
    signal a PID the kernel has since given to another process."""
    root = str(head_dir(port))
    mine: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if root in " ".join(p.info["cmdline"] or ()) or any(f.path.startswith(root) for f in p.open_files()):
                mine[p.pid] = p
    for p in list(mine.values()):  # descendants (multiprocessing helpers have no file of the head open)
        with contextlib.suppress(psutil.Error):
            mine |= {c.pid: c for c in p.children(recursive=True) if c.pid != os.getpid()}
    return sorted(mine.values(), key=lambda p: p.pid)


def head_pids(port: int) -> list[int]:
    return [p.pid for p in head_processes(port)]


def job_processes(submission_id: str, unseen: list[int] | None = None) -> list[psutil.Process]:
    """Every process on this host of one Ray job unbroken submitted: its wrapper, driver, workers and their helpers
    all carry its submission id in their environment (``JOB_ENV``, set in the job's runtime_env) -- another run's job
    on the same head never does. ``unseen`` (when given) gets the Ray processes whose environment this user may not
    read (another user's: a watchdog running as someone else): any of them may be the job's."""
    ours = attempt_marks(submission_id)
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            mark = p.environ().get(JOB_ENV)
            if mark is not None and ours(mark):
                found.append(p)
        except psutil.AccessDenied:
            if unseen is not None and _rays(p):
                unseen.append(p.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def attempt_marks(submission_id: str) -> Callable[[str], bool]:
    """Which marks are the job's: its own, and -- for an attempt whose driver was re-attached (``<first>-d<N>``,
    control/watchdog/reattach.py) -- those of the attempt's other drivers, the first's above all: its run host, Ray
    Train's controller and workers carry it (they are the host's, which the first driver started)."""
    first = re.sub(r"-d\d+$", "", submission_id)
    return lambda mark: mark == first or re.fullmatch(re.escape(first) + r"-d\d+", mark) is not None


def _rays(p: psutil.Process) -> bool:
    """Whether a process looks like Ray's or a Ray job's (by its command line, which any user may read)."""
    try:
        return "ray" in " ".join(p.cmdline())
    except psutil.AccessDenied:
        return True  # not even that can be read: it may be
    except psutil.Error:
        return False


def terminate(procs: list[psutil.Process], wait_s: float) -> None:
    """SIGTERM and up to ``wait_s`` to exit (SIGKILL at once when 0), then SIGKILL what is left; returns once every
    one has exited (a zombie has: psutil's own wait would wait for its parent to reap it)."""
    for sig, deadline in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if running(p)]
        if not deadline or not alive:
            continue
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        poll_until(lambda procs=alive: not any(running(p) for p in procs), deadline, every_s=0.05)


def running(p: psutil.Process) -> bool:
    """Alive and not a zombie (an exited child of ours waits for its parent to reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
