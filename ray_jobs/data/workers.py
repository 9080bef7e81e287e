"""Validating and tokenizing source batches, in this process or a pool of processes, results in source order.

A batch's result depends only on the batch (records are split into train/eval by their own hash, tokenized one by
one), so the pool's size never changes what is staged: packing, which does carry state from batch to batch, runs in
the staging process on results taken in source order. Memory is bounded by the batches in flight (a window of two
per worker), not by the dataset.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ray_jobs.config import DataConfig
from ray_jobs.data.records import Record, Reject, batch_records, record_in_eval
from ray_jobs.data.sources import SourceBatch
from ray_jobs.data.tokenize import Examples, Tokenized, chat_renderer

# Below this much source, starting worker processes (each imports transformers) costs more than it saves.
POOL_MIN_BYTES = 8 << 20


@dataclass
class BatchResult:
    """One batch validated and tokenized: its record count, rejects by stage, and examples per split."""

    records: int
    invalid: list[Reject]
    examples: dict[str, Examples]
    token_rejects: dict[str, list[Reject]] = field(default_factory=dict)


class BatchWork:
    """What a worker needs to turn a batch into a BatchResult (pickled once into each worker process)."""

    def __init__(self, tokenizer, tokenizer_name: str, data: DataConfig):
        self.tokenizer, self.tokenizer_name, self.data = tokenizer, tokenizer_name, data
        self._render = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_render": None}  # a closure over the tokenizer: rebuilt where it runs

    def render(self):
        if self._render is None and self.data.format == "chat":
            self._render = chat_renderer(self.tokenizer, self.tokenizer_name, self.data.train_on)
        return self._render

    def __call__(self, batch: SourceBatch, split: str) -> BatchResult:
        records, invalid = batch_records(batch, self.data, split, self.render())
        out = BatchResult(len(records) + len(invalid), invalid, {})
        for name, recs in zip(("train", "eval"), self._split(records), strict=True):
            # a chat rendering already holds the template's special tokens; adding the tokenizer's would double BOS
            tok = Tokenized(self.tokenizer, recs, self.data.seq_len, add_special_tokens=self.data.format != "chat")
            out.examples[name], out.token_rejects[name] = tok.flat, tok.rejects
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


def _run(batch: SourceBatch, split: str) -> BatchResult:
    return _WORK(batch, split)


def pool_size(data: DataConfig, source_bytes: int) -> int:
    """Worker processes for this staging: ``data.workers`` when set, else one per core once the source is big."""
    if data.workers:
        return data.workers
    return (os.cpu_count() or 1) if source_bytes >= POOL_MIN_BYTES else 1


def results(work: BatchWork, batches: Iterable[tuple[Any, str, SourceBatch]], workers: int) -> Iterator[tuple]:
    """``(key, result)`` for each ``(key, split, batch)``, in order; ``workers`` > 1 runs them in processes."""
    if workers <= 1:
        for key, split, batch in batches:
            yield key, work(batch, split)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the staging process may run threads (Prefect, fsspec) a fork would copy mid-lock
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(work,)) as pool:
        pending: deque = deque()
        for key, split, batch in batches:
            pending.append((key, pool.submit(_run, batch, split)))
            if len(pending) >= 2 * workers:
                key0, fut = pending.popleft()
                yield key0, fut.result()
        while pending:
            key0, fut = pending.popleft()
            yield key0, fut.result()
