"""Reading, validating and tokenizing source pieces: in this process, a pool of processes, or Ray actors across a
cluster; results in source order.

A piece's result depends only on the piece (records are split into train/eval by their own hash, tokenized one by
one, numbered from the piece's start), so where and how parallel it ran never changes what is staged: packing,
which does carry state from piece to piece, runs in the staging process on results taken in source order. Memory is
bounded by the pieces in flight (a window of two per worker), not by the dataset.

A hand-written window over an ordered pool, not Ray Data: Ray Data's ``map_batches`` keeps order only with
``preserve_order`` and has no resumable position (ray#37633), and staging resumes at the piece it was on.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ray_jobs.config import DataConfig
from ray_jobs.config.record_formats import record_format
from ray_jobs.data.documents import DocPieces, DocSink, Documents
from ray_jobs.data.records import Record, Reject, batch_records, record_char_limit, record_in_eval
from ray_jobs.data.sources import Position, SourceBatch, SourceRange, read_range
from ray_jobs.data.tokenize import Examples, Tokenized, chat_renderer

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger("unbroken.staging")

# Below this much source, starting worker processes (each imports transformers) costs more than it saves.
POOL_MIN_BYTES = 8 << 20


@dataclass
class BatchResult:
    """One batch validated and tokenized: its record count, rejects by stage, and examples per split."""

    records: int
    invalid: list[Reject]
    examples: dict[str, Examples]
    token_rejects: dict[str, list[Reject]] = field(default_factory=dict)
    end: Position = Position()  # where the piece ended; numbered from 1 when ``relative``
    relative: bool = False
    long: dict[str, list[tuple[int, DocPieces]]] = field(default_factory=dict)  # ``text``: long documents' pieces
    counts: dict[str, int] = field(default_factory=dict)  # documents, pieces, cut_documents, truncated

    def segments(self, split: str) -> Iterator[Examples | DocPieces]:
        """The split's examples in record order: runs of inline examples, and long documents' pieces."""
        ex, at = self.examples[split], 0
        for n, doc in self.long.get(split, []):
            if n > at:
                yield ex.slice(at, n)
            yield doc
            at = n
        if at < len(ex.lengths):
            yield ex.slice(at, len(ex.lengths))

    def placed(self, at: Position) -> Position:
        """Number this result's rejects as the lines (rows) of the file they are, given that the piece began at
        ``at``; returns where the next piece begins."""
        if not self.relative:
            return self.end
        shift = at.next - 1
        for r in [*self.invalid, *(r for rs in self.token_rejects.values() for r in rs)]:
            r.line += shift
        self.relative = False
        return Position(self.end.offset, self.end.next + shift)


class BatchWork:
    """What a worker needs to turn a batch into a BatchResult (pickled once into each worker process)."""

    def __init__(
        self,
        tokenizer,
        tokenizer_name: str,
        data: DataConfig,
        doc_dir: str | None = None,
        formats: dict[str, str] | None = None,
    ):
        self.tokenizer, self.tokenizer_name, self.data = tokenizer, tokenizer_name, data
        self.doc_dir = doc_dir  # where long documents' pieces go on this machine; None: Ray's object store
        self.formats = formats or {}  # a mixture's: source file URL -> its record shape, when not data.format
        self._renders: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_renders": {}}  # closures over the tokenizer: rebuilt where they run

    def data_for(self, url: str) -> DataConfig:
        """The data config a source file's records are read with: ``data`` in the file's own format."""
        fmt = self.formats.get(url, self.data.format)
        return self.data if fmt == self.data.format else self.data.model_copy(update={"format": fmt})

    def render(self, data: DataConfig | None = None):
        """The chat template renderer when records of ``data``'s format (this staging's by default) go through the
        template, else None (decided by the format and whether the tokenizer has a template; a shape that needs one
        and lacks it fails here)."""
        from ray_jobs.data.shapes import uses_template

        data = data or self.data
        if data.format not in self._renders:
            render = None
            if uses_template(data, self.tokenizer, self.tokenizer_name):
                # the format's own train_on when it forces one (a preference record learns its final replies)
                train_on = record_format(data.format).train_on or data.train_on
                render = chat_renderer(self.tokenizer, self.tokenizer_name, train_on)
            self._renders[data.format] = render
        return self._renders[data.format]

    def __call__(self, piece: SourceBatch | SourceRange, split: str) -> BatchResult:
        data = self.data_for(piece.url)
        batch = read_range(piece, record_char_limit(data)) if isinstance(piece, SourceRange) else piece
        records, invalid = batch_records(batch, data, split, self.render(data))
        out = BatchResult(len(records) + len(invalid), invalid, {}, end=batch.end)
        out.relative = isinstance(piece, SourceRange)
        counts = {"documents": 0, "pieces": 0, "cut_documents": 0, "truncated": 0}
        for name, recs in zip(("train", "eval"), self._split(records), strict=True):
            if record_format(data.format).documents:
                docs = Documents(self.tokenizer, recs, data.seq_len, data.text_overlap_tokens, DocSink(self.doc_dir))
                out.long[name] = docs.long
                counts["documents"] += docs.counts.documents
                counts["pieces"] += docs.counts.pieces
                counts["cut_documents"] += docs.counts.cut
            else:
                docs = Tokenized(self.tokenizer, recs, data.seq_len, data.too_long, self.render(data))
                counts["truncated"] += docs.truncated
            out.examples[name], out.token_rejects[name] = docs.flat, docs.rejects
        out.counts = counts
        return out

    def _split(self, records: list[Record]) -> tuple[list[Record], list[Record]]:
        if self.data.eval is not None:  # a separate eval source: a record's split is its file's
            return [r for r in records if r.split == "train"], [r for r in records if r.split == "eval"]
        ev = [record_in_eval(r, self.data.eval_fraction) for r in records]
        return [r for r, e in zip(records, ev, strict=True) if not e], [
            r for r, e in zip(records, ev, strict=True) if e
        ]


_WORK: BatchWork | None = None


def _init_worker(work: BatchWork) -> None:
    global _WORK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no threads on top
    _WORK = work


def _run(piece: SourceBatch | SourceRange, split: str) -> BatchResult:
    assert _WORK is not None, "a worker process or actor runs pieces only after _init_worker gave it its work"
    return _WORK(piece, split)


def pool_size(data: DataConfig, source_bytes: int) -> int:
    """Worker processes for this staging: ``data.workers`` when set, else one per core once the source is big."""
    if data.workers:
        return data.workers
    return (os.cpu_count() or 1) if source_bytes >= POOL_MIN_BYTES else 1


Pieces = Iterable[tuple[Any, str, SourceBatch | SourceRange]]


def results(work: BatchWork, pieces: Pieces, workers: int) -> Iterator[tuple]:
    """``(key, result)`` for each ``(key, split, piece)``, in order; ``workers`` > 1 runs them in processes."""
    if workers <= 1:
        for key, split, piece in pieces:
            yield key, work(piece, split)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the staging process may run threads (Prefect, fsspec) a fork would copy mid-lock
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(work,)) as pool:
        yield from _in_order(
            pieces, lambda piece, split: pool.submit(_run, piece, split), lambda f: f.result(), workers
        )


def _in_order(pieces: Pieces, submit, result, workers: int) -> Iterator[tuple]:
    """Submit pieces keeping at most two per worker in flight; yield ``(key, result)`` in submission order."""
    pending: deque = deque()
    for key, split, piece in pieces:
        pending.append((key, submit(piece, split)))
        if len(pending) >= 2 * workers:
            key0, handle = pending.popleft()
            yield key0, result(handle)
    while pending:
        key0, handle = pending.popleft()
        yield key0, result(handle)


class StageActor:
    """A Ray actor holding one BatchWork (the tokenizer is loaded once per actor, not once per piece)."""

    def __init__(self, work: BatchWork):
        _init_worker(work)

    def run(self, piece: SourceBatch | SourceRange, split: str) -> BatchResult:
        return _run(piece, split)

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def cluster_size(data: DataConfig) -> int:
    """Actors for a staging on the cluster: ``data.workers`` when set, else one per CPU of the cluster."""
    import ray

    return data.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))


def ray_results(work: BatchWork, pieces: Pieces, workers: int) -> Iterator[tuple]:
    """``results`` on Ray actors spread over the cluster's nodes (each reads its pieces from storage itself). An
    actor lost with its node is restarted and its piece retried by Ray; a data error is raised as itself."""
    import ray

    actor = ray.remote(StageActor).options(
        num_cpus=1,
        max_restarts=3,
        max_task_retries=3,
        scheduling_strategy="SPREAD",
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
    )
    work_ref = ray.put(work)
    # Ray types a new actor as "its handle or the class" (so that @ray.method-decorated methods type-check); it is
    # always the handle, whose methods are looked up at run time
    actors = [cast("ActorHandle[StageActor]", actor.remote(work_ref)) for _ in range(workers)]
    nodes = ray_get([a.node.remote() for a in actors])  # every actor up (its tokenizer loaded) before the first piece
    log.info(
        "staging with %d actors on %d nodes: %s",
        workers,
        len(set(nodes)),
        ", ".join(f"{n[:12]} x{nodes.count(n)}" for n in sorted(set(nodes))),
    )
    turn = iter(range(1 << 62))

    def submit(piece, split):  # round robin: every actor gets pieces; the window keeps each at most two ahead
        return actors[next(turn) % workers].run.remote(piece, split)

    try:
        yield from _in_order(pieces, submit, ray_get, workers)
    finally:
        for a in actors:
            ray.kill(a)


def ray_get(refs):
    """``ray.get``, raising a task's own exception (a StagingError names file and line) rather than Ray's wrap."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(refs)
    except RayTaskError as e:
        if isinstance(e.cause, Exception):
            raise e.cause from None
        raise
