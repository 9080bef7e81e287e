"""A lease on shared storage: at most one watchdog acts on a run at a time.

Why storage and not a Prefect global concurrency limit: the lease lives next to the run it protects, so it holds
across watchdogs that talk to *different* Prefect servers (a scheduled deployment, a person's
``unbroken watchdog --once`` on a laptop with an ephemeral server, a second team's server), and it needs no server
set-up. Its only requirement is an exclusive create, which every storage we support has (a hard link locally and on
NFS, a conditional PUT on S3 -- an object store that ignores those is refused before its first lease).

Generations: ``runs/<run>/leases/lease-00000007.json``. The newest generation is the lease. To acquire, a watchdog
reads the newest one; if it is released or expired, it creates the next generation exclusively, with its content in
the same step (never an empty file a full disk or a kill -9 could leave behind), and of several watchdogs racing for
that name exactly one succeeds. The holder renews by rewriting its own file, and releases by marking it released. The
generation number doubles as a fencing token: before each action with side effects (writing the run record,
submitting a job) the holder checks that no newer generation exists and that its own has not run out, so a holder
that stalled past its expiry and lost the lease cannot act on a stale view.

Expiry never compares two machines' clocks: a generation has run out once the storage's clock has moved ``ttl_s``
past the time the storage stamped on its last write (``storage_now`` against ``modified_at``), and the holder judges
its own lease by its own monotonic clock since it last renewed -- which runs out before anyone else's view does. A
generation that cannot be read (written by hand, torn by a storage fault) expires the same way, by its stamp.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field

from ray_jobs.coordination import check_conditional_writes, create_exclusive, modified_at, storage_now
from ray_jobs.poll import poll_until, repeating
from ray_jobs.storage import Layout, StorageFull, fs_and_path, join, read_json, write_json_atomic

_NAME = re.compile(r"lease-(\d{8})\.json$")
DEFAULT_TTL_S = 300.0  # what a generation without a readable ttl_s lasts


class LeaseLost(RuntimeError):
    """The lease expired or another watchdog took it: whatever this holder was doing must stop."""


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
    renewed: float = field(default_factory=time.monotonic)  # this holder's clock when it last wrote its generation

    def __post_init__(self) -> None:
        self.lease_dir = self.lease_dir or Layout(self.storage).lease_dir(self.run)

    @property
    def url(self) -> str:
        return _url(self.lease_dir, self.generation)

    def _body(self, released: bool = False) -> dict:
        now = time.time()  # for people reading the file; expiry is judged by the storage's stamp, not by this
        return {
            "owner": self.owner,
            "generation": self.generation,
            "ttl_s": self.ttl_s,
            "written_at": now,
            "released": released,
        }

    def check(self) -> None:
        """Raise LeaseLost unless this is still the newest generation and it has not run out by this holder's own
        clock (since its last renewal: earlier than by anyone else's view, so two holders never overlap)."""
        gens = _generations(self.lease_dir)
        if not gens or gens[-1] != self.generation:
            raise LeaseLost(f"watchdog lease on run {self.run!r} was taken over (generation {gens[-1:]})")
        if time.monotonic() - self.renewed >= self.ttl_s:
            raise LeaseLost(f"watchdog lease on run {self.run!r} expired")

    def renew(self) -> None:
        self.check()
        started = time.monotonic()
        write_json_atomic(self.url, self._body(), durable=True)
        self.renewed = started

    @contextlib.contextmanager
    def kept(self, every_s: float | None = None) -> Generator[Lease, None, None]:
        """Renew the lease in the background while a long step runs (provisioning a cluster may take longer than
        the lease lasts: a second watchdog must not provision beside this one). A renewal that fails stops the
        renewals; the holder learns of it at its next ``check``."""

        def renew() -> bool:
            try:
                self.renew()
            except Exception:  # LeaseLost, or storage away: the next check() says so
                return False
            return True

        with repeating(renew, every_s or max(1.0, self.ttl_s / 3), f"lease-{self.run}"):
            yield self

    def release(self) -> None:
        fs, path = fs_and_path(self.url)
        try:
            write_json_atomic(self.url, self._body(released=True), durable=True)
        except StorageFull:
            # No room to mark it released (the disk filled while it was held): it would stay "held" until it runs
            # out (ttl_s: 5 min for a watchdog's pass), the run locked long after the disk is freed. A removal needs
            # no room: the previous generation (released) is the newest again, and the next holder takes this
            # number anew -- nobody else ever held it, and this holder is done with it.
            fs.rm(path)
            return
        for g in _generations(self.lease_dir):
            if g < self.generation:  # older generations are history; keep the directory small
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(fs_and_path(_url(self.lease_dir, g))[1])

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _url(lease_dir: str, generation: int) -> str:
    return join(lease_dir, f"lease-{generation:08d}.json")


@dataclass(frozen=True)
class Generation:
    """The newest generation as found: its number, its record (None when unreadable), the storage's stamp on it."""

    number: int
    body: dict | None
    stamped: float


def _newest(lease_dir: str) -> Generation | None:
    """The newest generation (None when there is none, or it vanished meanwhile)."""
    gens = _generations(lease_dir)
    if not gens:
        return None
    url = _url(lease_dir, gens[-1])
    try:
        stamped = modified_at(url)
        body = read_json(url)
    except FileNotFoundError:
        return None
    except ValueError:  # not JSON (a hand-made file, a store that tore it): it runs out by its stamp
        body = None
    if body is not None and not isinstance(body, dict):
        body = None
    return Generation(gens[-1], body, stamped)


def _held(g: Generation | None, storage: str) -> bool:
    """Whether ``g`` is a live lease: not released, and the storage's clock has not moved its ttl past its stamp."""
    if g is None or (g.body or {}).get("released"):
        return False
    ttl = _ttl(g.body)
    return storage_now(Layout(storage).probes()) - g.stamped < ttl


def _ttl(body: dict | None) -> float:
    try:
        return float((body or {})["ttl_s"])
    except (KeyError, TypeError, ValueError):
        return DEFAULT_TTL_S


def holder(storage: str, run: str, lease_dir: str | None = None) -> dict | None:
    """The current holder's record (``{"owner": "(unreadable)"}`` for a generation that cannot be read), or None
    when the run's lease is free."""
    lease_dir = lease_dir or Layout(storage).lease_dir(run)
    g = _newest(lease_dir)
    if g is None or not _held(g, storage):
        return None
    return g.body if g.body is not None else {"owner": "(unreadable lease file)", "generation": g.number}


def acquire(
    storage: str, run: str, owner: str | None = None, ttl_s: float = 300.0, lease_dir: str | None = None
) -> Lease | None:
    """Take the run's lease (or the one in ``lease_dir``), or return None when another holder has it (or won the
    race for it). StorageFull when the lease folder's storage has no room (nothing is left behind)."""
    lease_dir = lease_dir or Layout(storage).lease_dir(run)
    check_conditional_writes(Layout(storage).probes())
    g = _newest(lease_dir)
    if _held(g, storage):
        return None
    lease = Lease(storage, run, owner or owner_id(), (g.number if g else 0) + 1, ttl_s, lease_dir)
    started = time.monotonic()
    if not create_exclusive(lease.url, (json.dumps(lease._body()) + "\n").encode()):
        return None
    lease.renewed = started
    return lease


def acquire_wait(
    storage: str, run: str, wait_s: float = 180.0, ttl_s: float = 60.0, lease_dir: str | None = None
) -> Lease:
    """Take the lease, waiting for a holder to finish (watchdog passes are short); TimeoutError after ``wait_s``.
    A full storage is waited out the same way (someone may free it); StorageFull if it is still full then."""
    full: list[StorageFull] = []

    def take() -> Lease | None:
        full.clear()  # only a full storage at the last try counts
        try:
            return acquire(storage, run, ttl_s=ttl_s, lease_dir=lease_dir)
        except StorageFull as e:
            full[:] = [e]
            return None

    lease = poll_until(take, wait_s, every_s=0.2)
    if lease is not None:
        return lease
    if full:
        raise full[0]
    held = holder(storage, run, lease_dir)
    raise TimeoutError(f"{run!r}: lease held by {held} for more than {wait_s:.0f}s")
