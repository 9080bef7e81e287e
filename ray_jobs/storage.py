"""Shared storage through fsspec, and the storage layout contract (see DESIGN.md "Storage layout").

Every path that tests and tools read is built here, so the layout has exactly one definition.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.core import url_to_fs

if TYPE_CHECKING:
    from pyarrow.fs import PyFileSystem


def fs_and_path(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for a URL and the path inside it."""
    return url_to_fs(url)


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def as_url(like: str, path: str) -> str:
    """A path from an fsspec listing (protocol stripped) as a URL on the filesystem of ``like``; local paths stay bare."""
    if "://" not in like:
        return path
    fs, _ = fs_and_path(like)
    return fs.unstrip_protocol(path)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def listing(url: str) -> list[str]:
    """The paths directly under a folder, listed afresh (object-store listings are cached per process, and a stale
    one hides what was written since); none when the folder does not exist."""
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)
    try:
        return fs.ls(path, detail=False)
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout_s: float = 3600.0) -> Generator[None]:
    """Hold an exclusive lock on a local lock file (its folder made if missing) while the block runs; waiting longer
    than ``timeout_s`` for it is an error naming the file (its holder is hung: a dead one's lock is released)."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(path, timeout=timeout_s).acquire()
    except Timeout:
        raise TimeoutError(f"waited {timeout_s:g} s for the lock file {path}: another process holds it") from None
    with lock:
        yield


def exists(url: str) -> bool:
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)  # object-store listings are cached per process; this question needs the truth
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    """The whole object in one GET. (``fs.open`` on S3 pins the ETag of its HEAD and fails with ``FileExpired``
    when a writer replaces the object in between: the heartbeat is replaced every few seconds.)"""
    fs, path = fs_and_path(url)
    return fs.cat_file(path)


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url))


def file_sha256(url: str) -> str:
    """sha256 of a file on any storage, streamed (memory stays one buffer whatever the file's size)."""
    fs, path = fs_and_path(url)
    with fs.open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_version(info: dict[str, Any]) -> str:
    """The store's own change marker for a file (``fs.info``): ETag (+ version id) on object stores, else its mtime."""
    if etag := info.get("ETag") or info.get("etag"):
        return f"{etag}:{info['VersionId']}" if info.get("VersionId") else str(etag)
    return str(info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created") or "")


class StorageFull(OSError):
    """The storage has no room left (ENOSPC, a quota): what was being written is not there, whole or torn, and its
    temporary file is gone. Its message names the file."""


@contextlib.contextmanager
def storage_errors(url: str) -> Generator[None]:
    """Name the file in a full disk's error (:class:`StorageFull`); any other error passes through as it was."""
    try:
        yield
    except StorageFull:
        raise
    except OSError as e:
        if _no_room(e):
            raise StorageFull(errno.ENOSPC, f"storage full: cannot write {url}: {os.strerror(errno.ENOSPC)}") from e
        raise


def _no_room(e: OSError) -> bool:
    """A full disk or quota; a folder copy (shutil.Error) reports its files' errors as text."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return e.errno is None and any(f"[Errno {n}]" in str(e) for n in (errno.ENOSPC, errno.EDQUOT))


def write_local(path: str, data: bytes, durable: bool = True) -> str:
    """``data`` in a new temporary sibling of ``path`` (flushed to the disk when ``durable``: fsync); its path. A
    failed write leaves no temporary file behind."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def sync_dir(path: str) -> None:
    """Make a rename or link in the folder of ``path`` durable (a host crash must not lose a record just written);
    a filesystem that cannot sync a folder is left to its own guarantees."""
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_temporaries(folder_url: str) -> list[str]:
    """Remove what a writer killed between creating a temporary sibling and renaming it into place left in a local
    folder (``<name>.tmp-<id>``: :func:`write_bytes_atomic`, :func:`upload_file`); the names removed. An object
    store has no temporaries (a PUT is atomic), nor does a folder that does not exist. The caller must be the
    folder's one writer at this moment (staging holds its dataset's lock): a live writer's temporary is not told
    apart from a dead one's."""
    if not is_local(folder_url):
        return []
    folder = Path(fs_and_path(folder_url)[1])
    removed = sorted(p.name for p in folder.glob("*.tmp-*") if p.is_file())
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    return removed


def write_bytes_atomic(url: str, data: bytes, durable: bool = False) -> None:
    """Write to a temporary sibling, then move it into place: readers never see half a file.

    On a local/NFS path the move is an atomic rename; a write that fails (a full disk: StorageFull) leaves the old
    file and no temporary one. ``durable`` (a record: run.json, series.json, the champion pointer, a lease): the data
    reaches the disk before the rename, and the rename before this returns (fsync of the file and its folder), so a
    host crash leaves the old record or the new one, never a torn or lost one. Files rewritten every few seconds (a
    heartbeat, metrics) or verified by checksum (checkpoints, shards) skip it. Object stores have no rename, but a
    PUT is itself atomic (and durable) there, so the object is written directly.
    """
    fs, path = fs_and_path(url)
    with storage_errors(url):
        if is_local(url):
            tmp = write_local(path, data, durable)
            try:
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            if durable:
                sync_dir(path)
        else:
            with fs.open(path, "wb") as f:
                f.write(data)


def write_json_atomic(url: str, obj: Any, durable: bool = False) -> None:
    """``obj`` as JSON, every string in it masked (ray_jobs/secrets.py): whoever writes a record, a job spec, a
    manifest or a tracker's links, a credential in it never reaches storage. A reader that needs one back reveals it
    (a job's spec, a run record's config: ray_jobs/config/loading.py); one that compares compares masked values."""
    from ray_jobs.secrets import mask_tree

    write_bytes_atomic(url, (json.dumps(mask_tree(obj), indent=2, sort_keys=True) + "\n").encode(), durable)


def download_dir(url: str, local_dir: str | os.PathLike) -> Path:
    """Copy a storage folder to a local folder (a no-op returning the path itself when it is local)."""
    if is_local(url):
        return Path(url.removeprefix("file://"))
    fs, path = fs_and_path(url)
    local = Path(local_dir)
    if not (local / ".complete").exists():
        local.mkdir(parents=True, exist_ok=True)
        fs.get(path.rstrip("/") + "/", str(local) + "/", recursive=True)
        (local / ".complete").write_text(url)
    return local


def upload_file(local: str | os.PathLike, url: str) -> None:
    """Copy a local file to ``url`` without holding it in memory; readers see all of it or nothing (as above), and a
    failed copy (a full disk: StorageFull) leaves no temporary file."""
    fs, path = fs_and_path(url)
    with storage_errors(url):
        if is_local(url):
            import shutil

            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                shutil.copyfile(local, tmp)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:
            fs.put_file(str(local), path)


def upload_dir(local_dir: str | os.PathLike, url: str) -> None:
    """Publish a local folder at ``url`` so that it appears complete or not at all.

    Locally it is copied beside the target and renamed into place (a copy that fails -- a full disk -- is removed,
    the target left as it was); on object stores the files are uploaded with the folder's ``README.md`` (the
    completion marker readers check) last.
    """
    fs, path = fs_and_path(url)
    local = Path(local_dir)
    with storage_errors(url):
        if is_local(url):
            _replace_dir(local, path)
            return
        files = sorted(p for p in local.rglob("*") if p.is_file())
        marker = [p for p in files if p.name == "README.md"]
        for batch in ([p for p in files if p not in marker], marker):  # in parallel on async stores; the marker after
            if batch:
                fs.put([str(p) for p in batch], [join(path, str(p.relative_to(local))) for p in batch])


def _replace_dir(local: Path, path: str) -> None:
    staging = Path(f"{path}.partial-{uuid.uuid4().hex[:8]}")
    try:
        shutil.copytree(local, staging)
        if Path(path).exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class Layout:
    """Where everything lives under a storage root (the contract: docs/architecture.md's storage layout, which
    tests/unit/test_docs.py checks against this class)."""

    def __init__(self, storage: str) -> None:
        self.root = storage.rstrip("/")

    # datasets/<dataset_id>/...
    def dataset_dir(self, dataset_id: str) -> str:
        return join(self.root, "datasets", dataset_id)

    def dataset_manifest(self, dataset_id: str) -> str:
        return join(self.dataset_dir(dataset_id), "manifest.json")

    # datasets/sources/<key>.json : the sha256 staging read for a source file's (url, size, version)
    def source_index(self) -> str:
        return join(self.root, "datasets", "sources")

    # datasets/jobs/<submission>.json, .outcome.json : what a staging job on the cluster was given and how it ended
    def staging_job(self, submission_id: str, outcome: bool = False) -> str:
        return join(self.root, "datasets", "jobs", f"{submission_id}{'.outcome' if outcome else ''}.json")

    # models/<name>/ : base models unbroken built (the built-in tiny model)
    def model_dir(self, name: str) -> str:
        return join(self.root, "models", name)

    # runs/<run>/...
    def run_dir(self, run: str) -> str:
        return join(self.root, "runs", run)

    # index/active-runs/<run> : a marker per run the watchdog looks after (so it never lists every run)
    def active_index(self) -> str:
        return join(self.root, "index", "active-runs")

    # probes/ : the storage clock's and its conditional writes' probes, each removed once read (ray_jobs/coordination.py);
    # nothing lists this folder, so a probe in flight is never read as a run, a marker or a lease
    def probes(self) -> str:
        return join(self.root, "probes")

    # index/<backend>-runs/<run> : a marker per run whose cluster a backend's janitor has yet to see cleaned up
    # (control/backends: ``janitor_index``)
    def janitor_index(self, backend: str) -> str:
        return join(self.root, "index", f"{backend}-runs")

    def run_registry(self, run: str) -> str:
        return join(self.run_dir(run), "run.json")

    def job_spec(self, run: str, attempt: int) -> str:
        return join(self.run_dir(run), f"job-spec-{attempt:03d}.json")

    def metrics(self, run: str) -> str:
        return join(self.run_dir(run), "metrics.jsonl")

    def heartbeat(self, run: str) -> str:
        return join(self.run_dir(run), "heartbeat.json")

    def tracking(self, run: str) -> str:
        """Where each of the run's experiment trackers keeps its run (ray_jobs/train/tracking)."""
        return join(self.run_dir(run), "tracking.json")

    def train_starts(self, run: str) -> str:
        """How many times the current attempt's training started (its in-job restarts)."""
        return join(self.run_dir(run), "train-starts.json")

    def lease_dir(self, run: str) -> str:
        """``lease-<generation>.json`` files: which watchdog may act on the run (control/lease.py)."""
        return join(self.run_dir(run), "leases")

    def final_model(self, run: str) -> str:
        return join(self.run_dir(run), "final")

    def search_trials(self, run: str) -> str:
        """A search's trials as its job last saw them (ray_jobs/search/progress.py)."""
        return join(self.run_dir(run), "trials.json")

    def search_scheduler(self, run: str) -> str:
        """A search's ASHA rungs (ray_jobs/search/scheduler.py), so a restored search decides as before."""
        return join(self.run_dir(run), "scheduler.json")

    def score(self, run: str) -> str:
        """The final model's loss on its series' pinned eval set (the promotion gate reads it)."""
        return join(self.run_dir(run), "score.json")

    def samples(self, run: str) -> str:
        """Held-out prompts answered by the base and the final model (the job writes it, the flow publishes it)."""
        return join(self.run_dir(run), "samples.json")

    # series/<series>/... : the lineage of runs, its lease and the champion pointer
    def series_dir(self, series: str) -> str:
        return join(self.root, "series", series)

    def series_registry(self, series: str) -> str:
        return join(self.series_dir(series), "series.json")

    def series_lease_dir(self, series: str) -> str:
        return join(self.series_dir(series), "leases")

    def champion(self, series: str) -> str:
        """The champion pointer: which run's final folder, with every file's sha256 (switched atomically)."""
        return join(self.series_dir(series), "champion.json")

    # ray/<run>/ : Ray Train's own run storage; unbroken's checkpoint folders live in it (so Ray tracks them)
    def ray_storage(self) -> str:
        return join(self.root, "ray")

    def checkpoints_dir(self, run: str) -> str:
        return join(self.ray_storage(), run)


def pyarrow_filesystem(url: str) -> PyFileSystem | None:
    """A pyarrow filesystem for Ray Train's ``storage_filesystem`` that goes through the same fsspec config.

    Returns ``None`` for local paths (Ray handles those natively).
    """
    if is_local(url):
        return None
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, _ = fs_and_path(url)
    return PyFileSystem(FSSpecHandler(fs))


def strip_protocol(url: str) -> str:
    fs, path = fs_and_path(url)
    return path
