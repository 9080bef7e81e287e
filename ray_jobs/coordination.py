"""What the control plane needs of the storage to coordinate through it: a compare-and-set create (a file that
appears with its content in one step, or not at all), the storage's own clock (when it stamped a file, and its now:
staleness and lease expiry never compare two machines' clocks), and a check that an object store honours the
conditional writes that create rests on."""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid

from ray_jobs.errors import UserError
from ray_jobs.storage import fs_and_path, is_local, join, storage_errors, sync_dir, write_bytes_atomic, write_local


def create_exclusive(url: str, data: bytes) -> bool:
    """Create ``url`` with ``data`` only if nothing is there yet; False when it already exists.

    The one compare-and-set primitive shared storage offers everywhere, made so that the file appears with its
    content in one step -- never empty, never torn: locally (and on NFS) the data is written to a temporary file and
    hard-linked to the name (``link`` fails if the name exists); on S3 a conditional PUT (``If-None-Match: *``) with
    the body. Two writers racing for the same name: exactly one wins. (An exclusive create followed by a write would
    leave an empty file behind a full disk or a kill -9 in between: a lease nobody could ever take again.)
    """
    fs, path = fs_and_path(url)
    with storage_errors(url):
        if is_local(url):
            return _link_exclusive(path, data)
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except Exception as e:  # S3 answers 412 Precondition Failed when the object exists
            if "PreconditionFailed" in repr(e) or "412" in str(e):
                return False
            raise
        return True


def _link_exclusive(path: str, data: bytes) -> bool:
    tmp = write_local(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as e:  # a filesystem without hard links: exclusive create, and the file removed if torn
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        return _create_and_write(path, data)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    sync_dir(path)
    return True


def _create_and_write(path: str, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)  # ours alone (created exclusively): never leave it empty
        raise
    return True


def modified_at(url: str) -> float:
    """When the file was last written, by the storage's own clock (a local or NFS file's mtime, an object's
    LastModified): what staleness is measured by, never this machine's clock against another's."""
    fs, path = fs_and_path(url)
    if is_local(url):
        return os.stat(path).st_mtime
    fs.invalidate_cache(path)
    info = fs.info(path)
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    return when.timestamp() if hasattr(when, "timestamp") else float(when)


_CLOCKS: dict[str, tuple[float, float]] = {}  # folder -> (offset of the storage's clock from ours, when measured)
CLOCK_REFRESH_S = 60.0


def storage_now(folder: str) -> float:
    """Now, by the clock of the storage holding ``folder`` (the time a file written there now would be stamped
    with): one small probe written and removed there, then this machine's clock plus the offset found, measured
    again after a minute. Comparing a file's :func:`modified_at` with this compares one clock with itself."""
    now = time.time()
    offset, at = _CLOCKS.get(folder, (0.0, -CLOCK_REFRESH_S))
    if now - at >= CLOCK_REFRESH_S:
        probe = join(folder, f".clock-{uuid.uuid4().hex[:12]}")
        before = time.time()
        write_bytes_atomic(probe, b"")
        try:
            stamped = modified_at(probe)
        finally:
            fs, path = fs_and_path(probe)
            with contextlib.suppress(OSError):
                fs.rm_file(path)
        offset = stamped - (before + time.time()) / 2
        _CLOCKS[folder] = (offset, now)
    return time.time() + offset


_CONDITIONAL_OK: set[str] = set()


class ConditionalWritesIgnored(UserError, RuntimeError):
    """An object store that accepts a conditional create of an object that exists: it cannot keep leases."""


def check_conditional_writes(folder: str) -> None:
    """Refuse an object store that ignores conditional writes (``If-None-Match: *``), before the first lease is
    taken on it: creating one probe object twice must fail the second time. On such a store two watchdogs would
    both "win" a lease and both restart a run. Checked once per bucket per process; local paths need no check."""
    if is_local(folder):
        return
    fs, path = fs_and_path(folder)
    bucket = path.split("/", 1)[0]
    if bucket in _CONDITIONAL_OK:
        return
    probe = join(folder, f".conditional-probe-{uuid.uuid4().hex[:12]}")
    try:
        if not create_exclusive(probe, b"1"):
            raise ConditionalWritesIgnored(f"{probe}: a fresh probe object already exists")
        if create_exclusive(probe, b"2"):
            raise ConditionalWritesIgnored(
                f"the object store holding {folder} ignores conditional writes (If-None-Match: *): a second "
                "exclusive create of one object succeeded, so two watchdogs could both take a run's lease and both "
                "restart it. Use a store that honours them (AWS S3, MinIO, recent Ceph RGW, GCS/R2 through their "
                "S3 APIs), or a local/NFS storage path"
            )
    finally:
        with contextlib.suppress(OSError, FileNotFoundError):
            fs.rm_file(fs_and_path(probe)[1])
    _CONDITIONAL_OK.add(bucket)
