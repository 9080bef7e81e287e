"""The node's model cache: one verified local copy of a model folder on storage, shared by every rank of the node.

``<data.cache_dir>/models/`` holds, per storage URL (its name: a digest of the URL)::

    <digest>/               the verified copy; its marker, .verified.json, was written last, before the rename
    <digest>.lock           the lock every rank of the node takes around checking and fetching <digest>
    <digest>.tmp-<uuid>/    a download in progress, or what a killed one left (removed by the next lock holder)
    <digest>.old-<uuid>/    a corrupt copy moved aside to be removed (the same)

One rank of a node downloads, under the lock, into a temporary folder beside the final one; the copy is verified
(every file's size against the source's listing, its sha256 against the source's manifest when it has one) and
renamed into place whole. The other ranks wait on the lock and find it in place. A copy is checked again at every
use (``problem``) and fetched again when it is not intact: it is never loaded half-made or damaged.

The source's manifest is a ``sha256.json`` at the top of the folder on storage -- ``{relative path: sha256}``, the
shape of a champion pointer's ``files`` -- for whoever publishes a folder to vouch for its bytes. Where the source
has none (a folder unbroken published today, or any HF folder someone put on storage), the sha256 of each file is
computed here after the download and recorded, so later uses can tell a file changed on this node.

Nothing here is evicted: the shard cache's LRU eviction leaves ``models/`` alone (ray_jobs/data/cache.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict

from ray_jobs.progress import Reporter, every_s, polled
from ray_jobs.secrets import mask
from ray_jobs.storage import exclusive_lock, file_version, fs_and_path, join

log = logging.getLogger("unbroken.model")

MODELS_DIR = "models"  # under data.cache_dir; the shard cache never evicts it
MARKER = ".verified.json"  # inside a verified copy, written last
SOURCE_MANIFEST = "sha256.json"  # at the top of a folder on storage, optional: {relative path: sha256}
LOCK_TIMEOUT_S = 3600.0  # a rank waits this long for another's download (a big model on a slow link) before failing
HASH_THREADS = 8  # files hashed at once after a download (hashlib releases the GIL)
_RECORDED = {"bytes", "sha256", "mtime_ns"}  # what the marker holds of each file (CachedFile)


class CachedFile(TypedDict):
    bytes: int
    sha256: str
    mtime_ns: int  # when it was verified: a file whose mtime moved is hashed again


class Marker(TypedDict):
    """A node's copy's marker: where it came from, when it was verified, each file as verified, and the source as
    storage listed it then (each file's size and version: a folder republished at the same URL is another model)."""

    url: str  # masked
    verified_at: float
    sha256_from: str  # the source's manifest, or "computed on this node after the download"
    files: dict[str, CachedFile]
    source: dict[str, list[int | str]]  # relative path -> [bytes, the store's version marker: ETag, mtime]


class ModelCacheError(RuntimeError):
    """A model folder on storage could not be copied whole: its copy did not match its listing or its manifest."""


def cached_folder(url: str, cache_root: str | os.PathLike) -> Path:
    """A verified local copy of the storage folder ``url`` under ``<cache_root>/models/``: the one in place when it
    is intact, otherwise downloaded (once per node: the other ranks wait on the lock, then find it in place)."""
    root = Path(cache_root) / MODELS_DIR
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    final = root / digest
    fs, path = fs_and_path(url)
    with exclusive_lock(root / f"{digest}.lock", LOCK_TIMEOUT_S):
        _remove_leftovers(root, digest)  # we hold the lock: no one is writing them
        source = _listing(fs, path, url)  # one listing a use: the folder may have been published again meanwhile
        why = problem(final, url, source)
        if why is None:
            return final
        if final.exists():
            log.warning(
                "the node's copy of %s at %s is not to be used (%s): removing it and fetching it again", url, final, why
            )
            _remove(final, root, digest)
        _download(url, root, digest, source)
    return final


def problem(folder: Path, url: str, source: dict[str, list[int | str]] | None = None) -> str | None:
    """Why the copy at ``folder`` must not be loaded, or None when it is intact (and, given the ``source`` folder as
    storage lists it now, still a copy of it: a file added, removed, resized or rewritten there -- a base model or a
    ``final`` exported again at the same URL -- is another model).

    Cheap enough for every use: it reads the marker and stats each file, hashing only a file whose modification
    time changed since it was verified. Detected: no marker (a copy never finished, or one made before this
    cache), a missing, extra or resized file (truncated, half-written), a file rewritten in place with other bytes.
    Not detected: bytes changed on disk while the size and the modification time stayed (bit rot, a write that
    restored the time): that would take hashing every file at every use."""
    try:
        record = json.loads((folder / MARKER).read_text())
        files: dict[str, CachedFile] = record["files"]  # checked below: a marker is read, not trusted
    except FileNotFoundError:
        return "no marker: its download never finished" if folder.exists() else "not cached"
    except (ValueError, LookupError, TypeError):
        return "its marker is unreadable"
    if not (isinstance(files, dict) and all(isinstance(f, dict) and f.keys() >= _RECORDED for f in files.values())):
        return "its marker is unreadable"
    if record.get("url") != mask(url, ()):  # recorded masked, like everything unbroken writes
        return f"it is a copy of {record.get('url')}"
    if source is not None and record.get("source") != source:
        return (
            "its source changed on storage since it was copied"
            if record.get("source")
            else "its marker predates source versions"
        )
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MARKER}
    if on_disk != set(files):
        return _difference("its marker", set(files), on_disk)
    for rel, f in sorted(files.items()):
        st = (folder / rel).stat()
        if st.st_size != f["bytes"]:
            return f"{rel} is {st.st_size} bytes, {f['bytes']} were verified"
        if st.st_mtime_ns != f["mtime_ns"] and _sha256(folder / rel) != f["sha256"]:
            return f"{rel} was rewritten since it was verified (its sha256 differs)"
    return None


def _download(url: str, root: Path, digest: str, source: dict[str, list[int | str]]) -> None:
    """Copy ``url`` (``source``: its listing) into a temporary folder beside ``root/digest``, verify it, write its
    marker, rename it into place. Whatever fails on the way leaves no folder at ``root/digest``."""
    fs, path = fs_and_path(url)
    sizes = {rel: int(size) for rel, (size, _) in source.items()}
    expected = _source_manifest(fs, path, url, sizes)
    tmp = root / f"{digest}.tmp-{uuid.uuid4().hex[:8]}"
    local = [tmp / rel for rel in sizes]
    total = sum(sizes.values())
    log.info("copying %s (%d files, %.1f MB) to the node's model cache", url, len(sizes), total / 1e6)
    try:
        for p in local:
            p.parent.mkdir(parents=True, exist_ok=True)
        with polled(
            Reporter(f"model download of {url}", total, quiet_s=every_s(), log=log, tty=False), lambda: tree_bytes(tmp)
        ):
            fs.get([join(path, rel) for rel in sizes], [str(p) for p in local])
        record = _verify(tmp, url, sizes, expected, source)
        (tmp / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")  # last: it vouches for the rest
        os.replace(tmp, root / digest)  # the whole folder at once; nothing was at root/digest (checked under the lock)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _listing(fs, path: str, url: str) -> dict[str, list[int | str]]:
    """Every file under the folder as storage lists it now: relative path -> [bytes, version marker]."""
    prefix = len(path.rstrip("/")) + 1
    fs.invalidate_cache(path)
    found = fs.find(path, detail=True)
    listed = [(p[prefix:], info) for p, info in sorted(found.items()) if info.get("type") != "directory"]
    files: dict[str, list[int | str]] = {rel: [int(info["size"]), file_version(info)] for rel, info in listed}
    if not files:
        raise ModelCacheError(f"{url}: no model folder there (no files)")
    return files


def _source_manifest(fs, path: str, url: str, sizes: dict[str, int]) -> dict[str, str] | None:
    """The sha256 of every file as the source's ``sha256.json`` gives it, or None when the folder has none. It must
    name exactly the files listed (but itself): a file it does not vouch for, or one it names that is not there (a
    folder still being published), is an error."""
    if SOURCE_MANIFEST not in sizes:
        return None
    expected = json.loads(fs.cat_file(join(path, SOURCE_MANIFEST)))
    listed = set(sizes) - {SOURCE_MANIFEST}
    if set(expected) != listed:
        raise ModelCacheError(
            f"{url}: {SOURCE_MANIFEST} does not match the folder: {_difference(SOURCE_MANIFEST, set(expected), listed)}"
        )
    return expected


def _verify(
    tmp: Path, url: str, sizes: dict[str, int], expected: dict[str, str] | None, source: dict[str, list[int | str]]
) -> Marker:
    """The marker's record of the downloaded copy, after checking every file's size against the listing and its
    sha256 against the source's manifest (when there is one; otherwise the sha256 is recorded as computed here)."""
    wrong = [
        f"{rel}: {(tmp / rel).stat().st_size} bytes, storage lists {n}"
        for rel, n in sizes.items()
        if (tmp / rel).stat().st_size != n
    ]
    if wrong:
        raise ModelCacheError(f"{url}: the copy does not match the listing: {'; '.join(wrong)}")
    with ThreadPoolExecutor(min(HASH_THREADS, len(sizes))) as pool:
        digests = dict(zip(sizes, pool.map(_sha256, [tmp / rel for rel in sizes]), strict=True))
    if expected is not None:
        wrong = [rel for rel, h in expected.items() if digests[rel] != h]
        if wrong:
            raise ModelCacheError(f"{url}: sha256 of {', '.join(wrong)} does not match {SOURCE_MANIFEST}")
    files: dict[str, CachedFile] = {
        rel: {"bytes": sizes[rel], "sha256": digests[rel], "mtime_ns": (tmp / rel).stat().st_mtime_ns} for rel in sizes
    }
    sha256_from = SOURCE_MANIFEST if expected is not None else "computed on this node after the download"
    return {
        "url": mask(url, ()),
        "verified_at": time.time(),
        "sha256_from": sha256_from,
        "files": files,
        "source": source,
    }


def _remove_leftovers(root: Path, digest: str) -> None:
    """Folders a killed download (or removal) of ``digest`` left. Only the lock's holder writes them: safe to remove."""
    for p in [*root.glob(f"{digest}.tmp-*"), *root.glob(f"{digest}.old-*")]:
        log.info("removing %s, left by a download or removal that did not finish", p)
        shutil.rmtree(p, ignore_errors=True)


def _remove(final: Path, root: Path, digest: str) -> None:
    """Move a copy aside at once (a rank never finds half of it), then delete it."""
    old = root / f"{digest}.old-{uuid.uuid4().hex[:8]}"
    os.replace(final, old)
    shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree_bytes(path: Path) -> int:
    """Bytes under ``path``; a file another process on the node renames or removes meanwhile is not counted."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            total += p.stat().st_size if p.is_file() else 0
    return total


def _difference(by: str, expected: set[str], found: set[str]) -> str:
    parts = []
    if missing := sorted(expected - found):
        parts.append(f"missing {', '.join(missing)}")
    if extra := sorted(found - expected):
        parts.append(f"not vouched for by {by}: {', '.join(extra)}")
    return "; ".join(parts)
