"""What ``data.train`` names, source by source, and how a mixture's weights become its staged train rows.

:func:`train_sources` expands ``data.train`` into concrete sources (a hub dataset becomes the Parquet file its split
is written to: ``ray_jobs/data/hub.py``), each with its format, weight and the config field a problem names. One
source stages exactly as the plain string naming it would (the same dataset id). Several are a mixture:

- each source's records are packed into rows of their own (staging closes the open row at a source's end), so a
  train row never holds two sources;
- the weights are shares of those rows: the heaviest source (the one with the most rows among equal weights) is
  staged once, each other source ``round(weight / heaviest weight * heaviest's rows)`` times a row (at least one):
  every row as many whole times as fit, then the rest (or, below one pass, a subsample) chosen by a stable hash of
  its index -- deterministic, no randomness that a library upgrade could change;
- the shards interleave the sources (every shard holds each source's share of its rows, so each data rank trains
  the mixture, not one source), a shard's rows grouped by source; the manifest names each shard's rows by source and
  each source's counts, so a row (shard file, row in it) is traced to its source.

The mixture is a property of the staged dataset: the training cursor, resume and elastic reading are unchanged. Eval
is unweighted: each source gives ``data.eval_fraction`` of its records by record hash (or ``data.eval`` is the eval
split).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from pydantic import JsonValue

from ray_jobs.config import DataConfig
from ray_jobs.config.record_formats import record_format
from ray_jobs.data.fingerprint import Source
from ray_jobs.data.formats.base import StagingError
from ray_jobs.data.pack import ShardPart


@dataclass(frozen=True)
class ConfigSource:
    """One concrete source of ``data.train``: what staging reads, in which shape, its weight, and whom to blame."""

    field: str  # the config field a problem names: data.train, or data.train[1] in a list of several
    url: str  # a file, folder or URL; for a hub dataset, the local Parquet file its split was written to
    format: str  # its record shape (data.format's values; "auto" until staging or the check resolves it)
    weight: float = 1.0
    where: str = ""  # as the config names it: the path, or hub:owner/name (split=...)


def train_sources(data: DataConfig) -> list[ConfigSource]:
    """``data.train`` as its concrete sources, in order: a plain string is one (field ``data.train``); a list names
    each ``data.train[i]`` (one alone: ``data.train``). A hub dataset is loaded (from the local cache when the hub
    does not answer) and its split written once under ``data.work_dir/hub``; StagingError naming the field when it
    cannot be had."""
    if isinstance(data.train, str):
        return [ConfigSource("data.train", data.train, data.format, 1.0, data.train)]
    one = len(data.train) == 1
    out = []
    for i, entry in enumerate(data.train):
        field = "data.train" if one else f"data.train[{i}]"
        if entry.path is not None:
            url = entry.path
        else:
            from ray_jobs.data.hub import hub_file

            url = hub_file(entry, field, data.work_dir)
        out.append(ConfigSource(field, url, entry.format or data.format, entry.weight, entry.where))
    return out


@dataclass(frozen=True)
class Mixture:
    """Several train sources, their formats resolved."""

    sources: list[ConfigSource]

    @property
    def format(self) -> str:
        """The sources' one format, or ``mixed``."""
        formats = {s.format for s in self.sources}
        return formats.pop() if len(formats) == 1 else "mixed"

    def config(self) -> list[JsonValue]:
        """What of the mixture shapes the staged rows (part of the dataset id)."""
        return [{"weight": s.weight, "format": s.format} for s in self.sources]


def prepare(data: DataConfig) -> tuple[DataConfig, Mixture | None]:
    """``data`` as staging reads it, ``format: auto`` resolved. One source: a plain config naming its URL in its
    format (so it stages as that string would). Several: the Mixture, each source's format resolved on its own
    records, and ``data.format`` (what ``data.eval`` is read as) resolved from the first source's when ``auto``."""
    from ray_jobs.data.shapes import resolve_format

    sources = train_sources(data)
    if len(sources) == 1:
        (s,) = sources
        return resolve_format(data.model_copy(update={"train": s.url, "format": s.format}), s.url, s.field), None
    mix = Mixture([replace(s, format=resolve_format(_as(data, s.format), s.url, s.field).format) for s in sources])
    formats = {s.format for s in mix.sources}
    one_a_row = any(record_format(f).pairs or record_format(f).labelled for f in formats)  # trained another way
    if one_a_row and len(formats) > 1:
        named = ", ".join(f"{s.field} is {s.format}" for s in mix.sources)
        raise StagingError(f"data.train: preference records cannot be mixed with other shapes ({named})")
    if record_format(data.format).detected:
        data = data.model_copy(update={"format": mix.sources[0].format})
    return data, mix


def one_source_a_file(files: list[Source], mix: Mixture) -> None:
    """StagingError when a file is of two sources (a folder and a file in it, say): it would have two weights."""
    seen: dict[str, int] = {}
    for f in files:
        first = seen.setdefault(f.url, f.source)
        if first != f.source:
            raise StagingError(
                f"{mix.sources[f.source].field}: {f.url} is a file of {mix.sources[first].field} too; a file belongs "
                "to one source of a mixture (give it one weight)"
            )


def _as(data: DataConfig, fmt: str) -> DataConfig:
    return data.model_copy(update={"format": fmt})


def source_rows(marks: list[dict[str, int]]) -> list[int]:
    """Each source's train rows, from where staging marked each source's rows to end."""
    ends = [m["rows"] for m in marks]
    return [end - start for start, end in zip([0, *ends], ends, strict=False)]


def empty_sources(mix: Mixture, marks: list[dict[str, int]]) -> list[str]:
    """The sources that packed no train row (a weight cannot share out nothing)."""
    return [s.field for s, n in zip(mix.sources, source_rows(marks), strict=True) if not n]


def mixture_shards(
    mix: Mixture, marks: list[dict[str, int]], shards_for: Callable[[int], int]
) -> list[list[ShardPart]]:
    """The mixture's train shards over the spill's rows (each source's ending at its mark); ``shards_for(rows)``:
    how many shards that many staged rows make."""
    rows = source_rows(marks)
    staged = staged_rows(rows, [s.weight for s in mix.sources])
    chosen = [picks(r, t, i) for i, (r, t) in enumerate(zip(rows, staged, strict=True))]
    starts = [m["rows"] - r for m, r in zip(marks, rows, strict=True)]
    return layout(starts, chosen, [s.field for s in mix.sources], shards_for(sum(staged)))


def staged_rows(rows: list[int], weights: list[float]) -> list[int]:
    """How many train rows each source stages: the heaviest (most rows among equal weights) once, each other
    ``weight / heaviest weight`` times as many, rounded half up, at least one."""
    top = max(range(len(rows)), key=lambda i: (weights[i], rows[i]))
    return [max(1, math.floor(w / weights[top] * rows[top] + 0.5)) for w in weights]


def picks(rows: int, staged: int, salt: int) -> np.ndarray:
    """Which of a source's ``rows`` its ``staged`` rows are, in order: every row as many whole times as fit, then the
    rest -- the rows of the lowest stable hash of (``salt``, index), in index order."""
    reps, extra = divmod(staged, rows)
    order = np.argsort(_mix64(np.arange(rows, dtype=np.uint64) ^ np.uint64(salt * 0x9E3779B97F4A7C15 % 2**64)))
    chosen = np.sort(order[:extra], kind="stable")
    return np.concatenate([np.tile(np.arange(rows, dtype=np.int64), reps), chosen.astype(np.int64)])


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-spread 64-bit hash of each value (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def layout(starts: list[int], chosen: list[np.ndarray], labels: list[str], n_shards: int) -> list[list[ShardPart]]:
    """The train shards of a mixture: source ``i``'s staged rows are spill rows ``starts[i] + chosen[i]``; the
    sources are interleaved (each one's k-th row placed at (k + 1/2) / its count, ties by source) and cut into
    ``n_shards`` equal runs, each shard's rows grouped by source."""
    counts = [len(c) for c in chosen]
    total = sum(counts)
    src = np.repeat(np.arange(len(counts)), counts)
    at = np.concatenate([(np.arange(n) + 0.5) / n for n in counts])
    merged = src[np.lexsort((src, at))]  # by place, then by source
    bounds = [round(i * total / n_shards) for i in range(n_shards + 1)]
    taken = [0] * len(counts)
    out = []
    for s in range(n_shards):
        per = np.bincount(merged[bounds[s] : bounds[s + 1]], minlength=len(counts))
        parts = []
        for i, n in enumerate(per.tolist()):
            if n:
                parts.append(ShardPart(labels[i], runs(starts[i] + chosen[i][taken[i] : taken[i] + n])))
                taken[i] += n
        out.append(parts)
    return out


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Row indices as runs ``[lo, hi)`` of consecutive rows, in order."""
    if not len(rows):
        return []
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(part[0]), int(part[-1]) + 1) for part in np.split(rows, cut)]
