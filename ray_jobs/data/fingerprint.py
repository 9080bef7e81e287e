"""Source fingerprints: what a store says about a file's version, and the sha256 an earlier staging read for it.

The dataset id hashes each source file's sha256 (content-addressed: the same bytes give the same id wherever and
however they are staged). Reading a 10 GB source just to learn that nothing changed is the waste this module removes:
the first staging of a file records ``(url, size, version) -> sha256`` in a small index on storage, where ``version``
is what the store keeps for free (mtime locally, ETag and version id on S3), and later stagings take the sha256 from
there with one metadata call per file. ``data.verify_sources`` hashes in full every time instead.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray_jobs.data.sources import StagingError, list_sources
from ray_jobs.secrets import mask
from ray_jobs.storage import Layout, file_sha256, file_version, fs_and_path, join, read_json, write_json_atomic


@dataclass
class Source:
    """One source file: where it is, its size and version marker, and (once known) the sha256 of its bytes."""

    url: str
    size: int
    version: str
    sha256: str = ""
    settled: bool = True  # False: changed too recently for its version marker to tell one write from the next
    source: int = 0  # which of a mixture's sources (data.train[i]) the file is of


# A file system's mtime ticks coarsely (a few ms on Linux): two writes of the same size within one tick share a
# version. Like git's "racily clean" rule, a file changed this recently is hashed every time and never indexed.
SETTLE_S = 2.0


def describe(url: str, field_name: str, source: int = 0) -> list[Source]:
    """The files of a source with their size and version marker (one metadata call each, no reads); ``source``:
    which of a mixture's sources they are of."""
    out = []
    for u in list_sources(url, field_name):
        fs, path = fs_and_path(u)
        try:
            info = fs.info(path)
        except OSError as e:
            raise StagingError(f"{u}: cannot read: {e}") from e
        mtime = info.get("mtime")
        settled = info.get("ETag") is not None or not isinstance(mtime, float) or time.time() - mtime > SETTLE_S
        out.append(Source(u, int(info.get("size") or 0), file_version(info), settled=settled, source=source))
    return out


def hash_file(url: str) -> str:
    """sha256 of a file, streamed (memory stays one buffer whatever the file's size)."""
    try:
        return file_sha256(url)
    except OSError as e:
        raise StagingError(f"{url}: cannot read: {e}") from e


class SourceIndex:
    """``<storage>/datasets/sources/<key>.json``: the sha256 staging read for a (url, size, version)."""

    def __init__(self, storage: str):
        self.dir = Layout(storage).source_index()

    def _url(self, src: Source) -> str:
        key = hashlib.sha256(f"{src.url}\0{src.size}\0{src.version}".encode()).hexdigest()[:32]
        return join(self.dir, f"{key}.json")

    def lookup(self, src: Source) -> str:
        """The recorded sha256, or "" when this version of the file was never hashed (or its entry is unreadable)."""
        if not src.version or not src.settled:  # no change marker, or one that cannot tell yet: nothing to trust
            return ""
        try:
            entry = read_json(self._url(src))
        except (OSError, ValueError):
            return ""
        # the index holds the URL masked (storage never holds a credential): compared as such
        same = (entry.get("url"), entry.get("size"), entry.get("version")) == (mask(src.url, ()), src.size, src.version)
        return entry.get("sha256", "") if same else ""

    def remember(self, src: Source) -> None:
        if src.version and src.settled:
            entry = {"url": src.url, "size": src.size, "version": src.version, "sha256": src.sha256}
            write_json_atomic(self._url(src), entry)


def known_hashes(sources: dict[str, list[Source]], storage: str) -> bool:
    """Fill in every sha256 the index knows; True when it knew them all."""
    index = SourceIndex(storage)
    for files in sources.values():
        for src in files:
            src.sha256 = src.sha256 or index.lookup(src)
    return all(src.sha256 for files in sources.values() for src in files)


def resolve_hashes(
    sources: dict[str, list[Source]],
    storage: str,
    verify: bool,
    hash_many: Callable[[list[str]], list[str]] | None = None,
) -> int:
    """Fill in every source's sha256: from the index where its version was hashed before (unless ``verify``), else
    by reading it (``hash_many``: how to hash several files, e.g. in parallel on a cluster; one by one here by
    default). Returns the number of files read."""
    if not verify:
        known_hashes(sources, storage)
    todo = [src for files in sources.values() for src in files if verify or not src.sha256]
    hashes = (hash_many or (lambda urls: [hash_file(u) for u in urls]))([src.url for src in todo])
    index = SourceIndex(storage)
    for src, sha in zip(todo, hashes, strict=True):
        src.sha256 = sha
        index.remember(src)
    return len(todo)
