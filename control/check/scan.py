"""``unbroken check``'s look at the data: every record of every source read, validated, tokenized and counted by
staging's own code, with nothing written and neither Prefect nor Ray started.

A source's pieces go through staging's workers (``ray_jobs/data/workers.BatchWork``, in a pool of processes once the
sources are big enough, as staging's): JSONL lines read bounded (``lines.py``), each record's shape per
``data.format`` (``shapes.py``, ``records.py``), tokenized with the run's tokenizer (``tokenize.py``, ``fit.py`` for
``data.too_long``, ``documents.py`` for ``text``), the eval split by record hash. What they made is counted as
staging's spill counts it, its rows by its packer's rule (``pack.RowCounter``), and judged by its reject policy
(``ray_jobs/data/refusal.py``): what staging would refuse is a problem naming ``file:line``, the reasons those
``rejects.jsonl`` would hold. tests/unit/test_check_scan.py stages the same data and compares.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from control.check.findings import Finding, ok, problem, warning
from ray_jobs.config import Config, DataConfig
from ray_jobs.config.record_formats import record_format
from ray_jobs.errors import UserError

if TYPE_CHECKING:  # check imports without transformers; the scan imports it when it runs
    from transformers import PreTrainedTokenizerBase

    from ray_jobs.data.fingerprint import Source
    from ray_jobs.data.mixture import Mixture
    from ray_jobs.data.preference import PairPacker
    from ray_jobs.data.records import Reject
    from ray_jobs.data.sources import SourceBatch, SourceRange
    from ray_jobs.data.tokenize import Examples
    from ray_jobs.data.workers import BatchResult, BatchWork

KEEP_REJECTS = 100  # of each kind kept to name (rejects.jsonl's order: invalid records, then too long in train, eval)
SHOWN_REJECTS = 2  # named under a refusal: a data error is at most 3 lines


@dataclass
class SourceScan:
    """What one source (a config field) gave, as staging counts it."""

    field: str  # data.train, data.eval (a mixture's data.train[1])
    url: str
    files: list[Source]
    records: int = 0
    rejects: int = 0  # counted against data.max_reject_fraction
    dropped: int = 0  # by data.too_long=drop (listed in rejects.jsonl, not counted against the limit)
    tokens: int = 0  # of the examples it gave, in both splits

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class Scan:
    """Every source read: staging's counts (its spill's names), the rows each split packs into, the first rejects."""

    data: DataConfig  # ``format: auto`` resolved, as staging resolves it
    tokenizer: PreTrainedTokenizerBase  # the run's
    tokenizer_name: str
    sources: list[SourceScan]
    counts: Counter[str]
    rows: dict[str, int]
    listed: dict[str, list[Reject]]  # of each kind, the first KEEP_REJECTS
    seconds: float = 0.0
    workers: int = 1

    def rejects(self) -> list[Reject]:
        """The rejects kept, in the order staging's rejects.jsonl lists them (dropped records among them)."""
        return [r for kind in self.listed.values() for r in kind]

    def files(self, split: str) -> list[Source]:
        return [f for s in self.sources if (s.field == "data.eval") == (split == "eval") for f in s.files]


class _Packed:
    """A packer whose rows are built to be counted: preference records, one row each (``PairPacker``)."""

    def __init__(self, packer: PairPacker) -> None:
        self.packer, self.rows = packer, 0

    def add(self, ex: Examples) -> int:
        n = len(self.packer.add(ex))
        self.rows += n
        return n

    def finish(self) -> int:
        n = len(self.packer.finish())
        self.rows += n
        return n


class Tally:
    """Staging's counts of what the workers made (its spill's), each split's rows counted by its packer's rule, and
    the first rejects of each kind."""

    def __init__(self, data: DataConfig) -> None:
        from ray_jobs.data.pack import Packer, RowCounter
        from ray_jobs.data.spill import REJECT_KINDS, SPLITS
        from ray_jobs.data.staging import packer_for

        packer = packer_for(data)
        self.per_example = getattr(packer, "per_example", 1)  # sequences an example of a record is made of
        # the pad id only fills rows' padding: counting rows needs none
        self.packing = {
            s: RowCounter(data.seq_len) if packer is Packer else _Packed(packer(data.seq_len, 0)) for s in SPLITS
        }
        self.counts: Counter[str] = Counter()
        self.listed: dict[str, list[Reject]] = {k: [] for k in REJECT_KINDS}
        self.marks: list[dict[str, int]] = []  # a mixture's: where each train source's rows end

    def add(self, result: BatchResult, source: SourceScan) -> None:
        self.counts["records"] += result.records
        source.records += result.records
        self.counts.update(result.counts)
        self._rejects("invalid", result.invalid, source)
        for split in self.packing:
            self._rejects(split, result.token_rejects[split], source)
            for ex in _examples(result, split):
                tokens = int(ex.lengths.sum())
                self.counts[f"{split}_examples"] += len(ex.lengths) // self.per_example
                self.counts["train_tokens"] += tokens if split == "train" else 0
                source.tokens += tokens
                self.packing[split].add(ex)

    def _rejects(self, kind: str, rejects: list[Reject], source: SourceScan) -> None:
        dropped = sum(r.dropped for r in rejects)
        self.counts["rejects"] += len(rejects) - dropped
        self.counts["dropped"] += dropped
        source.rejects += len(rejects) - dropped
        source.dropped += dropped
        self.listed[kind] += rejects[: KEEP_REJECTS - len(self.listed[kind])]

    def end_source(self) -> None:
        """A mixture's train source read: its last row closed, where its rows end marked (as staging's spill)."""
        self.packing["train"].finish()
        self.marks.append({"rows": self.packing["train"].rows})

    def finish(self, mix: Mixture | None = None) -> dict[str, int]:
        """Each split's rows, its open row closed; a mixture's train rows as its weights stage them."""
        from ray_jobs.data.mixture import source_rows, staged_rows

        for packing in self.packing.values():
            packing.finish()
        rows = {split: packing.rows for split, packing in self.packing.items()}
        if mix is not None:
            rows["train"] = sum(staged_rows(source_rows(self.marks), [s.weight for s in mix.sources]))
        return rows


def _examples(result: BatchResult, split: str) -> Iterator[Examples]:
    """A split's examples in record order, long documents' pieces read from where the worker left them."""
    from ray_jobs.data.documents import DocPieces

    for part in result.segments(split):
        if isinstance(part, DocPieces):
            yield from part.read()
            part.discard()
        else:
            yield part


def scan_source(source: SourceScan, split: str, work: BatchWork, tally: Tally, workers: int) -> None:
    """Every record of one source, its files in order, through staging's workers into ``tally`` (each of a
    mixture's sources is scanned alike). Rejects are numbered as the lines (rows) of their file."""
    from ray_jobs.data.sources import Position, pieces
    from ray_jobs.data.staging import BATCH_BYTES
    from ray_jobs.data.workers import results

    def todo() -> Iterator[tuple[int, str, SourceBatch | SourceRange]]:
        for i, f in enumerate(source.files):
            for piece in pieces(f.url, f.size, Position(), BATCH_BYTES):
                yield i, split, piece

    current, at = -1, Position()
    for i, result in results(work, todo(), workers):
        if i != current:
            current, at = i, Position()
        at = result.placed(at)
        tally.add(result, source)


def sources(data: DataConfig, mix: Mixture | None) -> list[tuple[str, str, str]]:
    """(config field, URL, split) of each source staging reads: ``data`` as :func:`mixture.prepare` made it (a hub
    dataset's split a local file), a mixture's sources one by one."""
    train = [(s.field, s.url, "train") for s in mix.sources] if mix else [("data.train", str(data.train), "train")]
    return [*train, *([("data.eval", data.eval, "eval")] if data.eval else [])]


def scan(cfg: Config, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str) -> Scan:
    """Every record of ``data.train`` and ``data.eval`` read as staging reads them; a UserError (a StagingError
    naming the file) for what stops staging before any count: a missing or unreadable file, a shape ``auto`` cannot
    tell, a chat format without a chat template."""
    from ray_jobs.data.fingerprint import describe
    from ray_jobs.data.mixture import prepare
    from ray_jobs.data.workers import BatchWork, pool_size

    started = time.monotonic()
    data, mix = prepare(cfg.data)  # format: auto resolved (each of a mixture's sources on its own records)
    found = [(SourceScan(f, url, describe(url, f)), split) for f, url, split in sources(data, mix)]
    formats = (
        {f.url: s.format for s, (src, _) in zip(mix.sources, found, strict=False) for f in src.files} if mix else None
    )
    tally = Tally(data)
    workers = pool_size(data, sum(s.bytes for s, _ in found))
    with tempfile.TemporaryDirectory(prefix="unbroken-check-") as docs:  # long documents' pieces, read back at once
        work = BatchWork(tokenizer, tokenizer_name, data, docs, formats)
        for url in {f.url for src, _ in found for f in src.files}:  # a chat format without a template fails here
            work.render(work.data_for(url))
        for source, split in found:
            scan_source(source, split, work, tally, workers)
            if mix is not None and split == "train":
                tally.end_source()  # a row never holds two of a mixture's sources
    rows = tally.finish(mix)
    s = Scan(data, tokenizer, tokenizer_name, [src for src, _ in found], tally.counts, rows, tally.listed)
    s.seconds, s.workers = time.monotonic() - started, workers
    return s


def load_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    """The run's tokenizer, as staging gets it: the built-in model's (trained here, as its build does), or the one
    of the model's folder or hub id."""
    from ray_jobs.model.builtin import is_builtin, train_char_tokenizer
    from ray_jobs.model.loading import load_tokenizer as load

    if is_builtin(cfg.model):
        return train_char_tokenizer()
    return load(cfg.model.name_or_path, cfg.data.cache_dir)


def data(cfg: Config) -> tuple[list[Finding], Scan | None]:
    """The data's findings: each source's counts, the splits and their rows, and what staging would refuse; the
    scan, for the plan (None when the records could not all be read)."""
    from control.check import probes
    from ray_jobs.storage import is_local

    try:
        tokenizer = load_tokenizer(cfg)
    except Exception as e:  # OSError, ValueError: a model folder without a tokenizer (the model's finding says more)
        why = f"cannot load a tokenizer from {cfg.model.name_or_path}: {type(e).__name__}: {e}"
        return [warning("data", f"every record not read ({why}); the first ones:"), *probes.data(cfg)], None
    try:
        s = scan(cfg, tokenizer, cfg.model.name_or_path)
    except UserError as e:  # a store that did not serve a file is certain only for a local one
        named = [cfg.data.train] if isinstance(cfg.data.train, str) else [s.path or "" for s in cfg.data.train]
        certain = e.users_fault or all(is_local(url) for url in [*named, *([cfg.data.eval] if cfg.data.eval else [])])
        return [(problem if certain else warning)("data", str(e))], None
    except Exception as e:  # a store's own error (permissions on a bucket, a protocol without a filesystem)
        return [warning("data", f"cannot read the sources now: {type(e).__name__}: {e}")], None
    return [*(ok("data", _source_line(src)) for src in s.sources), _splits(s), *refusals(s)], s


def _source_line(s: SourceScan) -> str:
    dropped = f", {s.dropped:,} dropped" if s.dropped else ""
    return (
        f"{s.field}: {len(s.files)} file(s), {_mb(s.bytes)}, every record read: {s.records:,} records "
        f"({s.rejects:,} rejected{dropped}), {s.tokens:,} tokens"
    )


def _splits(s: Scan) -> Finding:
    c, d = s.counts, s.data
    unit = record_format(d.format).unit
    held = "data.eval" if d.eval else f"data.eval_fraction={d.eval_fraction:g} of data.train by record hash"
    return ok(
        "data",
        f"{d.format}: train {c['train_examples']:,} {unit}, {c['train_tokens']:,} tokens -> {s.rows['train']:,} rows "
        f"of {d.seq_len}; eval {c['eval_examples']:,} {unit} ({held}) -> {s.rows['eval']:,} rows; read in "
        f"{s.seconds:.2f} s ({_mb(sum(x.bytes for x in s.sources) / max(s.seconds, 1e-9))}/s, "
        f"{s.workers} process{'es' if s.workers > 1 else ''})",
    )


def refusals(s: Scan) -> list[Finding]:
    """What staging would refuse, by its rules in its order; rejects it tolerates, as a warning."""
    from ray_jobs.data.refusal import empty_input, empty_split, too_many_rejects

    c, train = s.counts, s.files("train")
    if why := empty_input(c, train + s.files("eval")):
        return [problem("data", why)]
    if why := too_many_rejects(c, s.data):
        return [problem("data", _named(why, s))]
    if why := empty_split(c, "train", train) or empty_split(c, "eval", train):
        return [problem("data", why)]
    if c["rejects"]:
        tolerated = f"{c['rejects']:,} of {c['records']:,} records rejected, within data.max_reject_fraction="
        return [warning("data", _named(tolerated + f"{s.data.max_reject_fraction:g}; staging lists them", s))]
    return []


def _named(why: str, s: Scan) -> str:
    """``why`` and the first rejects by ``file:line`` with their reasons, then how many more: at most 3 lines."""
    shown = [r for r in s.rejects() if not r.dropped][:SHOWN_REJECTS]
    lines = [f"  {r.where}: {r.reason}" for r in shown] or ["  (past the first of each kind kept)"]
    if (more := s.counts["rejects"] - len(shown)) > 0:
        lines[-1] += f" ... and {more:,} more (all in the staged dataset's rejects.jsonl)"
    return "\n".join([f"{why}:", *lines])


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} KB"
