"""Who uses a local head: a file per run (by its name and its storage) under the head's folder, and a ``kept``
marker when a run asked for ``cluster.keep_running``. A run ending stops the head only when no other run uses it
(``control/backends/local.py``: ``LocalHead.down``, ``stop_unreachable``) and none asked to keep it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

import psutil

from control.backends.localhost import head_dir

KEPT = "kept"  # marker file: a run asked for cluster.keep_running
USER_FRESH_S = 600.0  # a user file this young counts as live (its run may still be staging)


def user_file(port: int, run: str, storage: str) -> Path:
    """A run's registration as a user of the head on ``port``: by its name and its storage, since two projects on
    one machine may name their runs alike (one ending must not count the other's as itself)."""
    from control.records.run import storage_tag

    return head_dir(port) / "users" / f"{run}-{storage_tag(storage)}.json"


def add_user(port: int, run: str, storage: str, keep: bool = False) -> None:
    if keep:  # cluster.keep_running: no run stops this head; a person (or stop_local_head) does
        (head_dir(port) / KEPT).touch()
    user = user_file(port, run, storage)
    user.parent.mkdir(parents=True, exist_ok=True)
    body = {"run": run, "storage": storage, "pid": os.getpid(), "host": socket.gethostname(), "at": time.time()}
    user.write_text(json.dumps(body))


def kept(port: int) -> bool:
    """Whether a run asked to keep the head on ``port`` up."""
    return (head_dir(port) / KEPT).exists()


def head_users(port: int, ignore: tuple[str, str] | None = None) -> list[str]:
    """Runs that still use the local head on ``port``, but ``ignore`` (a run and its storage): their process lives,
    they registered lately, or their run is active (a job the watchdog looks after)."""
    from control.records.run import load_record

    live, ignored = [], user_file(port, *ignore) if ignore else None
    for f in sorted((head_dir(port) / "users").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            if f == ignored:
                continue
            user = json.loads(f.read_text())
            fresh = time.time() - user["at"] < USER_FRESH_S or _alive(user["pid"])
            reg = None if fresh else load_record(user["storage"], user["run"])
            if fresh or (reg is not None and reg.active):
                live.append(user["run"])
    return live


def forget_users(port: int) -> None:
    """The head on ``port`` stopped (or about to start afresh): its users and its keep marker are gone with it."""
    shutil.rmtree(head_dir(port) / "users", ignore_errors=True)
    with contextlib.suppress(OSError):
        (head_dir(port) / KEPT).unlink()


def _alive(pid: int) -> bool:
    return pid != os.getpid() and psutil.pid_exists(pid)
