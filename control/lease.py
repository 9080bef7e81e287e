"""A lease on shared storage: at most one watchdog acts on a run at a time.

Why storage and not a Prefect global concurrency limit: the lease lives next to the run it protects, so it holds
across watchdogs that talk to *different* Prefect servers (a scheduled deployment, a person's
``unbroken watchdog --once`` on a laptop with an ephemeral server, a second team's server), and it needs no server
set-up. Its only requirement is an exclusive create, which every storage we support has (``O_EXCL`` locally and on
NFS, a conditional PUT on S3).

Generations: ``runs/<run>/leases/lease-00000007.json``. The newest generation is the lease. To acquire, a watchdog
reads the newest one; if it is released or expired, it creates the next generation exclusively, and of several
watchdogs racing for that name exactly one succeeds. The holder may renew (rewrite its own file) and releases by
marking its file released. The generation number doubles as a fencing token: before an action with side effects
(submitting a job) the holder checks that no newer generation exists, so a holder that stalled past its expiry and
lost the lease cannot act on a stale view.

Expiry compares wall clocks of the machines involved; keep them NTP-synced (skew only matters at the scale of
``ttl_s``, minutes).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass

from ray_jobs.poll import poll_until
from ray_jobs.storage import Layout, create_exclusive, fs_and_path, join, read_json, write_json_atomic

_NAME = re.compile(r"lease-(\d{8})\.json$")


class LeaseLost(RuntimeError):
    """The lease expired and another watchdog took it: whatever this holder was doing must stop."""


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _generations(lease_dir: str) -> list[int]:
    fs, path = fs_and_path(lease_dir)
    fs.invalidate_cache(path)
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.search(n)))


@dataclass
class Lease:
    storage: str
    run: str  # what it protects: a run's name (or "series <name>" for a series' lease)
    owner: str
    generation: int
    ttl_s: float
    lease_dir: str = ""  # default: the run's (runs/<run>/leases)

    def __post_init__(self) -> None:
        self.lease_dir = self.lease_dir or Layout(self.storage).lease_dir(self.run)

    @property
    def url(self) -> str:
        return _url(self.lease_dir, self.generation)

    def _body(self, released: bool = False) -> dict:
        now = time.time()
        return {"owner": self.owner, "generation": self.generation, "acquired_at": now,
                "expires_at": now + self.ttl_s, "released": released}  # fmt: skip

    def check(self) -> None:
        """Raise LeaseLost unless this is still the newest generation and it has not expired."""
        gens = _generations(self.lease_dir)
        if not gens or gens[-1] != self.generation:
            raise LeaseLost(f"watchdog lease on run {self.run!r} was taken over (generation {gens[-1:]})")
        if read_json(self.url)["expires_at"] < time.time():
            raise LeaseLost(f"watchdog lease on run {self.run!r} expired")

    def renew(self) -> None:
        self.check()
        write_json_atomic(self.url, self._body())

    def release(self) -> None:
        body = self._body(released=True)
        body["expires_at"] = 0
        write_json_atomic(self.url, body)
        fs, _ = fs_and_path(self.url)
        for g in _generations(self.lease_dir):
            if g < self.generation:  # older generations are history; keep the directory small
                fs.rm(fs_and_path(_url(self.lease_dir, g))[1])

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _url(lease_dir: str, generation: int) -> str:
    return join(lease_dir, f"lease-{generation:08d}.json")


def _newest(lease_dir: str) -> tuple[int, dict | None]:
    """The newest generation number (0 when none) and its record (None if it vanished meanwhile)."""
    gens = _generations(lease_dir)
    if not gens:
        return 0, None
    try:
        return gens[-1], read_json(_url(lease_dir, gens[-1]))
    except FileNotFoundError:
        return gens[-1], None
    except ValueError:  # created exclusively a moment ago and not written yet: its creator is taking the lease
        return gens[-1], {"owner": "(being acquired)", "generation": gens[-1], "expires_at": float("inf")}


def _held(body: dict | None) -> bool:
    return body is not None and not body.get("released") and body["expires_at"] >= time.time()


def holder(storage: str, run: str, lease_dir: str | None = None) -> dict | None:
    """The current holder's record, or None when the run's lease is free."""
    _, body = _newest(lease_dir or Layout(storage).lease_dir(run))
    return body if _held(body) else None


def acquire(
    storage: str, run: str, owner: str | None = None, ttl_s: float = 300.0, lease_dir: str | None = None
) -> Lease | None:
    """Take the run's lease (or the one in ``lease_dir``), or return None when another holder has it (or won the
    race for it)."""
    lease_dir = lease_dir or Layout(storage).lease_dir(run)
    generation, body = _newest(lease_dir)
    if _held(body):
        return None
    lease = Lease(storage, run, owner or owner_id(), generation + 1, ttl_s, lease_dir)
    if not create_exclusive(lease.url, (json.dumps(lease._body()) + "\n").encode()):
        return None
    return lease


def acquire_wait(
    storage: str, run: str, wait_s: float = 180.0, ttl_s: float = 60.0, lease_dir: str | None = None
) -> Lease:
    """Take the lease, waiting for a holder to finish (watchdog passes are short); TimeoutError after ``wait_s``."""
    lease = poll_until(lambda: acquire(storage, run, ttl_s=ttl_s, lease_dir=lease_dir), wait_s, every_s=0.2)
    if lease is None:
        held = holder(storage, run, lease_dir)
        raise TimeoutError(f"{run!r}: lease held by {held} for more than {wait_s:.0f}s")
    return lease
