"""Hub datasets: a ``data.train`` source ``{hub: owner/name, split, subset, revision}`` loaded through the ``datasets``
library and its caches, its split written once as a Parquet file that staging reads like any other source.

The Parquet file is the split's rows alone (no schema metadata, fixed row groups), named by the cache files it was
written from, under ``data.work_dir/hub/``: staged as a file, its sha256 goes into the dataset id, so the id follows
the rows -- a new revision with other rows is a new dataset, the same rows loaded again are the same one.

Where the hub cannot be reached the dataset comes from the local cache alone, at once: ``HF_HUB_OFFLINE=1`` (or
``HF_DATASETS_OFFLINE=1``) says so, and otherwise one short look at the hub's endpoint does (without it ``datasets``
retries an unreachable hub for about 25 s before it looks in its cache). Offline, the ``datasets`` cache that an
earlier ``load_dataset`` prepared is read first (unless a revision is pinned: that cache keeps no revision), then the
hub cache ``hf download --repo-type dataset owner/name`` fills, through ``load_dataset`` on its snapshot folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ray_jobs.config.data import TrainSource
from ray_jobs.data.formats.base import SourceUnreadable, StagingError

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger("unbroken.staging")

PROBE_TIMEOUT_S = 3.0  # one look at the hub's endpoint; longer than any healthy round trip
UNANSWERED_S = 60.0  # a look that got no answer stands this long (a run expands its sources a few times)
_unanswered: dict[str, tuple[float, str]] = {}  # endpoint -> (when, why) of the last look that got no answer
ROW_GROUP_ROWS = 65_536  # of the written Parquet file: staging's pieces follow row groups
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_file(src: TrainSource, field: str, work_dir: str) -> str:
    """The local Parquet file holding the rows of ``src``'s split (written on first use); StagingError naming
    ``field`` when the dataset cannot be had."""
    assert src.hub is not None, "hub_file is given hub sources only"
    ds = load_split(src, field)
    return _written(ds, src, work_dir)


def load_split(src: TrainSource, field: str) -> Dataset:
    """The split as ``datasets`` loads it: from the hub when it answers, else from the local caches."""
    offline = why_offline()
    if offline is None:
        try:
            return _load(src.hub or "", src, field)
        except ConnectionError as e:  # the hub answered the look, then not the load: the caches may have it
            offline = f"the hub did not answer ({_first_line(e)})"
    return _from_cache(src, field, offline)


def why_offline() -> str | None:
    """Why the hub is not to be asked (an offline switch, or no answer to one look at its endpoint), or None."""
    import datasets.config
    import huggingface_hub.constants as hub

    on = [k for k in OFFLINE_ENV if os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")]
    if on or datasets.config.HF_HUB_OFFLINE or hub.HF_HUB_OFFLINE:
        return f"{(on or ['HF_HUB_OFFLINE'])[0]} is set"
    from huggingface_hub import get_session

    at, why = _unanswered.get(hub.ENDPOINT, (0.0, ""))
    if time.monotonic() - at < UNANSWERED_S:
        return why
    try:
        get_session().head(hub.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # whatever kept the look from an answer (DNS, refused, a timeout, a proxy) is the same
        why = f"the hub ({hub.ENDPOINT}) does not answer ({type(e).__name__})"
        _unanswered[hub.ENDPOINT] = (time.monotonic(), why)
        return why
    return None


@contextmanager
def offline() -> Generator[None]:
    """``datasets`` and ``huggingface_hub`` offline in this process for a while: no request, no retry."""
    import datasets.config
    import huggingface_hub.constants as hub

    before = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


def _from_cache(src: TrainSource, field: str, reason: str) -> Dataset:
    from huggingface_hub import snapshot_download

    hub_id = src.hub or ""
    first: Exception | None = None
    with offline():
        if src.revision is None:  # the datasets cache keeps the newest load, whatever its revision
            try:
                return _load(hub_id, src, field)
            except (ConnectionError, StagingError) as e:  # not cached, or cached without this split or subset
                first = e
        try:
            folder = snapshot_download(hub_id, repo_type="dataset", revision=src.revision, local_files_only=True)
        except Exception as e:  # LocalEntryNotFoundError, an incomplete snapshot: not there to read
            if isinstance(first, StagingError):  # the datasets cache holds it, without what was asked: say that
                raise first from e
            raise StagingError(_missing(src, field, reason)) from e
        log.info("%s: %s from the hub cache (%s): %s", field, hub_id, reason, folder)
        return _load(folder, src, field)


def _load(path: str, src: TrainSource, field: str) -> Dataset:
    """``load_dataset`` of ``path`` (a hub id, or a snapshot folder of one) for ``src``'s split and subset;
    StagingError naming ``field`` for a dataset, split or subset that is not there."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    revision = src.revision if path == src.hub else None  # a snapshot folder is one revision already
    try:
        ds = datasets.load_dataset(path, name=src.subset, split=src.split, revision=revision)
    except ConnectionError:  # (an OSError) the hub not reached and the datasets cache without it: the caller's
        raise
    except (DatasetNotFoundError, FileNotFoundError, ValueError) as e:
        raise StagingError(f"{field}: {src.where}: {_first_line(e)}") from e
    except OSError as e:
        raise SourceUnreadable(f"{field}: hub dataset {src.hub}: cannot read it: {_first_line(e)}") from e
    assert isinstance(ds, datasets.Dataset), "load_dataset with a split returns that split"
    return ds


def _missing(src: TrainSource, field: str, reason: str) -> str:
    """The one line an offline miss says: the id, the caches looked in, and what to do."""
    import datasets.config
    import huggingface_hub.constants as hub

    rev = f" --revision {src.revision}" if src.revision else ""
    return (
        f"{field}: hub dataset {src.hub} is not in the local caches ({datasets.config.HF_DATASETS_CACHE}, "
        f"{hub.HF_HUB_CACHE}) and {reason}; run `hf download --repo-type dataset {src.hub}{rev}` where the hub is "
        "reachable (same HF_HOME), then stage again"
    )


def _written(ds: Dataset, src: TrainSource, work_dir: str) -> str:
    """The split's rows as one Parquet file under ``work_dir/hub``, named by the cache files it comes from (written
    once; a file of the same name is the same rows)."""
    import pyarrow.parquet as pq

    if ds.num_rows != ds.data.num_rows:  # an indices mapping (never for a plain split): the rows it selects
        ds = ds.flatten_indices()
    files = [f["filename"] for f in ds.cache_files]
    assert files, "load_dataset without keep_in_memory maps its split from cache files"
    stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([src.hub, src.subset, src.split, stats]).encode()).hexdigest()[:16]
    folder = Path(work_dir) / "hub" / (src.hub or "").replace("/", "--") / (src.subset or "default")
    out = folder / f"{src.split}-{key}.parquet"
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        table = ds.data.table.replace_schema_metadata(None)  # the rows alone: the id follows them
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS)
        os.replace(tmp, out)
        log.info("%s: %d rows of %s written to %s", src.where, ds.num_rows, src.hub, out)
    return str(out)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
