"""Staging's work folder on local disk: packed rows and rejects spilled to files, and how far staging got.

Shards are cut at row counts that depend on the whole dataset (``shard_count``/``shard_bounds``), so rows can only be
written as shards once every source was read. Until then they wait here, as raw int32 (the size of the packed data,
on disk: memory holds one batch). ``progress.json`` is written after the files it vouches for were flushed, and says
which source file and position comes next, the packers' open rows, the counts, and the shards already written: a
killed staging truncates the files to what progress recorded and goes on from there, ending byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TypedDict

import numpy as np

from ray_jobs.data.documents import DocPieces
from ray_jobs.data.pack import Packer, PackerState, ShardEntry, ShardPart, write_shard
from ray_jobs.data.records import Reject
from ray_jobs.data.sources import Position
from ray_jobs.data.tokenize import IGNORE_INDEX
from ray_jobs.data.workers import BatchResult

SPLITS = ("train", "eval")
# rejects.jsonl lists records that failed validation first, then those too long or unrepresentable once tokenized
REJECT_KINDS = ("invalid", "train", "eval")
_COUNTS = ("records", "rejects", "dropped", "truncated", "documents", "pieces", "cut_documents", "train_examples",
           "eval_examples", "train_tokens", "train_target_tokens")  # fmt: skip


class SpillProgress(TypedDict):
    """``progress.json``: how far the spill got (written after its files, so it vouches for their sizes)."""

    dataset_id: str
    phase: str  # "read" (sources into the spill), then "shard" (the spill into Parquet shards)
    file: int  # the source file to read next
    position: dict[str, int]  # where in it (formats/base.Position's fields)
    packers: dict[str, PackerState]  # per split: its packer's open rows
    sizes: dict[str, int]  # bytes of each spill file this progress vouches for
    counts: dict[str, int]
    shards: dict[str, list[ShardEntry]]  # per split: the shards written
    marks: list[dict[str, int]]  # a mixture's: at the end of each source, its train rows and counts so far


class Spill:
    """The resumable state of one dataset's staging, in ``folder``."""

    def __init__(self, folder: Path, dataset_id: str, seq_len: int, pad_id: int, packer: type = Packer):
        self.folder, self.seq_len = folder, seq_len
        folder.mkdir(parents=True, exist_ok=True)
        self.progress = self._load(dataset_id)
        self.packers = {s: packer(seq_len, pad_id, self.progress["packers"].get(s)) for s in SPLITS}
        self._files = {}
        if any(self._size(name) < size for name, size in self.progress["sizes"].items()):
            self.progress = self._fresh(dataset_id)  # files shorter than progress says (a host crash): start over
            self.packers = {s: packer(seq_len, pad_id) for s in SPLITS}
        shutil.rmtree(self.doc_dir, ignore_errors=True)
        for name, size in self.progress["sizes"].items():
            with open(self._path(name), "ab") as f:
                f.truncate(size)  # bytes written after the last progress record are written again
            self._files[name] = open(self._path(name), "ab")  # noqa: SIM115 -- kept open across batches

    # -- what progress says
    @property
    def reading(self) -> bool:
        return self.progress["phase"] == "read"

    @property
    def start(self) -> tuple[int, Position]:
        return self.progress["file"], Position(**self.progress["position"])

    @property
    def counts(self) -> dict[str, int]:
        return self.progress["counts"]

    def rows(self, split: str) -> int:
        return self.progress["sizes"][f"{split}.rows"] // (3 * self.seq_len * 4)

    # -- reading sources
    def add(self, result: BatchResult) -> None:
        c = self.counts
        c["records"] += result.records
        for k, n in result.counts.items():
            c[k] += n
        self._rejects("invalid", result.invalid)
        for split in SPLITS:
            self._rejects(split, result.token_rejects[split])
            for part in result.segments(split):
                for ex in part.read() if isinstance(part, DocPieces) else [part]:
                    c[f"{split}_examples"] += len(ex.lengths) // getattr(self.packers[split], "per_example", 1)
                    if split == "train":
                        c["train_tokens"] += int(ex.lengths.sum())
                    self._rows(split, self.packers[split].add(ex))
                if isinstance(part, DocPieces):
                    part.discard()

    @property
    def doc_dir(self) -> Path:
        """Where this machine's workers leave long documents' pieces for :meth:`add` (emptied at every start: a
        killed staging's leftovers are read again from the sources)."""
        return self.folder / "docs"

    def commit(self, file_index: int, position: Position) -> None:
        """Record that every source before ``file_index``, and that file up to ``position``, is in the spill."""
        self.progress["file"], self.progress["position"] = file_index, asdict(position)
        self._save()

    def end_source(self) -> None:
        """A mixture's source is read whole: its last train row is closed (a row never holds two sources) and where
        its rows end is marked, with the counts so far."""
        self._rows("train", self.packers["train"].finish())
        marks = self.progress.setdefault("marks", [])
        marks.append({"rows": self.rows("train"), **{k: self.counts[k] for k in ("records", "rejects")}})

    @property
    def marks(self) -> list[dict[str, int]]:
        return self.progress.get("marks", [])

    def end_reading(self) -> None:
        for split in SPLITS:
            self._rows(split, self.packers[split].finish())
        self.progress["phase"] = "shard"
        self._save()

    # -- writing shards
    def write_split(self, split: str, shards: list[list[ShardPart]], out_dir: str, told=None) -> list[ShardEntry]:
        """The split's rows as Parquet shards, each made of the spill rows its parts name (those written before a
        kill are kept); ``told(rows)`` hears how many rows are written, after each shard."""
        done = self.progress["shards"].setdefault(split, [])
        written = sum(p.rows for shard in shards[: len(done)] for p in shard)
        self._flush()
        # read a shard's rows at a time (not a memory map of the whole spill: its pages would stay resident)
        with open(self._path(f"{split}.rows"), "rb") as f:
            for i in range(len(done), len(shards)):
                rows = np.concatenate([self._read(f, lo, hi) for part in shards[i] for lo, hi in part.runs])
                done.append(write_shard(split, i, rows, out_dir, shards[i]))
                self._save()
                written += len(rows)
                if told is not None:
                    told(written)
        return done

    def _read(self, f, lo: int, hi: int) -> np.ndarray:
        f.seek(lo * 3 * self.seq_len * 4)
        return np.fromfile(f, np.int32, (hi - lo) * 3 * self.seq_len).reshape(-1, 3, self.seq_len)

    def first_rejects(self, k: int) -> list[Reject]:
        out: list[Reject] = []
        for kind in REJECT_KINDS:
            with open(self._path(f"rejects-{kind}.jsonl"), "rb") as f:
                for line in f:
                    if len(out) == k:
                        return out
                    r = Reject.from_json(json.loads(line))
                    if not r.dropped:
                        out.append(r)
        return out

    def rejects_file(self) -> Path:
        """Every reject in one file, in rejects.jsonl's order."""
        self._flush()
        out = self.folder / "rejects.jsonl"
        with open(out, "wb") as dst:
            for kind in REJECT_KINDS:
                with open(self._path(f"rejects-{kind}.jsonl"), "rb") as src:
                    shutil.copyfileobj(src, dst)
        return out

    def remove(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- internals
    def _rows(self, split: str, rows: np.ndarray) -> None:
        if len(rows):
            self._write(f"{split}.rows", rows.tobytes())
            if split == "train":
                self.counts["train_target_tokens"] += int((rows[:, 1, :] != IGNORE_INDEX).sum())

    def _rejects(self, kind: str, rejects: list[Reject]) -> None:
        if rejects:
            dropped = sum(r.dropped for r in rejects)
            self.counts["rejects"] += len(rejects) - dropped
            self.counts["dropped"] += dropped
            body = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rejects)
            self._write(f"rejects-{kind}.jsonl", body.encode())

    def _write(self, name: str, data: bytes) -> None:
        self._files[name].write(data)
        self.progress["sizes"][name] += len(data)

    def _flush(self) -> None:
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())  # on disk before progress.json says so, or a host crash leaves holes

    def _size(self, name: str) -> int:
        try:
            return self._path(name).stat().st_size
        except FileNotFoundError:
            return 0

    def _save(self) -> None:
        self._flush()  # the files first: progress vouches for their sizes
        self.progress["packers"] = {s: p.state() for s, p in self.packers.items()}
        tmp = self.folder / "progress.json.tmp"
        tmp.write_text(json.dumps(self.progress))
        os.replace(tmp, self.folder / "progress.json")

    def _path(self, name: str) -> Path:
        return self.folder / name

    def _load(self, dataset_id: str) -> SpillProgress:
        try:
            progress = json.loads((self.folder / "progress.json").read_text())
            if progress.get("dataset_id") == dataset_id:
                return progress
        except (OSError, ValueError):
            pass
        return self._fresh(dataset_id)

    @staticmethod
    def _fresh(dataset_id: str) -> SpillProgress:
        names = [f"{s}.rows" for s in SPLITS] + [f"rejects-{k}.jsonl" for k in REJECT_KINDS]
        return {
            "dataset_id": dataset_id,
            "phase": "read",
            "file": 0,
            "position": asdict(Position()),
            "packers": {},
            "sizes": dict.fromkeys(names, 0),
            "counts": dict.fromkeys(_COUNTS, 0),
            "shards": {},
            "marks": [],
        }
