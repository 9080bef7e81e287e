"""Finding and reading source files: a file, a folder of JSONL/Parquet files, or a ``save_to_disk`` folder."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ray_jobs.storage import as_url, fs_and_path

_SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")


class StagingError(ValueError):
    """Data that cannot be staged; the message names the file (and line) at fault."""


def position_unit(url: str) -> str:
    """How a record's position in a source file is counted: JSONL lines, or rows of a columnar file."""
    return "row" if url.endswith((".parquet", ".arrow")) else "line"


@dataclass
class SourceFile:
    url: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def unit(self) -> str:
        return position_unit(self.url)


def list_sources(url: str, field_name: str = "data.train") -> list[str]:
    """The files of a source: the file itself, a ``datasets`` ``save_to_disk`` folder's Arrow files, or every
    JSONL/Parquet file under a folder, sorted."""
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)  # a bucket listing cached earlier in this process may predate new files
    if not fs.exists(path):
        raise StagingError(f"{field_name}: no such file or folder: {url}")
    if fs.isfile(path):
        return [url]
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    if "dataset_dict.json" in names:
        raise StagingError(f"{field_name}: {url} holds several splits (a DatasetDict); point at one, e.g. {url}/train")
    if "state.json" in names:  # a datasets.Dataset.save_to_disk folder: its Arrow files, in order
        with fs.open(f"{path.rstrip('/')}/state.json") as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
        return [f"{url.rstrip('/')}/{name}" for name in files]
    found = sorted(p for p in fs.find(path) if p.endswith(_SOURCE_SUFFIXES))
    if not found:
        raise StagingError(f"{field_name}: folder {url} has no {'/'.join(_SOURCE_SUFFIXES)} files")
    return [as_url(url, p) for p in found]


def read_sources(url: str, field_name: str) -> list[SourceFile]:
    """Every file of a source, read whole (its bytes are hashed into the dataset id)."""
    out = []
    for u in list_sources(url, field_name):
        fs, path = fs_and_path(u)
        try:
            with fs.open(path, "rb") as f:
                out.append(SourceFile(u, f.read()))
        except OSError as e:
            raise StagingError(f"{u}: cannot read: {e}") from e
    return out
