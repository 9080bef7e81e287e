"""Reading staged shards on a worker: per-rank rows and a resumable cursor.

A worker's rows are memory-mapped, never loaded: the node cache keeps each shard decoded once as a raw int32
``.npy`` beside its Parquet file, and :class:`ShardRows` gathers just the rows a batch asks for from those maps. A
worker's memory is the batch (and an 8-byte permutation entry per row of its own), whatever the dataset's size.

The data is laid out for a fixed number of *data ranks* ``V`` (``cluster.num_workers``, its ``max`` when elastic),
whatever the world size: data rank ``v`` owns train shards ``v, v+V, ...``, and the order of its rows in an epoch is
a permutation seeded by (seed, v, epoch). So the position in the data is fully described by one :class:`Cursor`
(epoch, position) per data rank -- the run's global cursor -- and resuming jumps straight to it: no batch is read or
built for the positions that were already consumed.

A step trains ``V x grad_accum_steps`` micro-batches, micro-batch ``a`` of data rank ``v`` being the ``a``-th
``micro_batch_size`` rows from ``v``'s cursor (:class:`StepPlan`). With ``w`` workers, each runs ``V*accum/w`` of them
in order, so the rows every step trains on are the same at any world size (only who computes them changes): an
elastic run that shrinks and grows uses every training row of an epoch exactly once. With ``w == V`` worker ``r`` is
data rank ``r``, as before there were data ranks.

With ``train.epochs`` a run ends after its last pass: the steps are set by the data rank with the most rows
(``ray_jobs/config/epochs.py``), and a row another data rank reads past its own last pass is masked from the loss
(:meth:`StepPlan.micro_batch`): every row trains exactly ``epochs`` times, the batch keeping its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ray_jobs.contracts.dataset import Shard
from ray_jobs.data.cache import ShardCache

IGNORE_INDEX = -100  # a label the loss skips (transformers' and torch's cross-entropy default)


def rank_shards(entries: list[Shard], rank: int, world_size: int) -> list[Shard]:
    """The train shards rank ``rank`` reads: every ``world_size``-th, starting at its rank."""
    if len(entries) < world_size:
        raise ValueError(
            f"the dataset has {len(entries)} train shards but there are {world_size} workers; "
            f"raise data.min_shards to at least cluster.num_workers (or lower data.shard_mb) and restage"
        )
    return entries[rank::world_size]


class ShardRows:
    """The rows of some shards in order, as one indexable set; ``take`` gathers rows (copying only those)."""

    def __init__(self, parts: list[np.ndarray], seq_len: int):
        self.parts, self.seq_len = parts, seq_len  # each [rows, 3, seq_len] int32, memory-mapped
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, position_ids) int64 arrays ``[len(idx), seq_len]`` of rows ``idx``."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.empty((len(idx), 3, self.seq_len), dtype=np.int32)
        part = np.searchsorted(self.starts, idx, side="right") - 1
        for k in np.unique(part):
            sel = part == k
            out[sel] = self.parts[k][idx[sel] - self.starts[k]]
        wide = out.astype(np.int64)
        return wide[:, 0], wide[:, 1], wide[:, 2]


def open_rows(cache: ShardCache, entries: list[Shard], seq_len: int) -> ShardRows:
    """The rows of ``entries`` memory-mapped from the node cache (each shard fetched and decoded on first use).

    Position ids restart at 0 for every packed example; passed to the model, they keep examples from attending
    to each other. Shards from staging version 1 have none: every row then counts 0..seq_len-1, as it was trained.
    """
    return ShardRows([np.load(p, mmap_mode="r") for p in cache.rows_paths(entries, seq_len)], seq_len)


def load_rows(cache: ShardCache, entries: list[Shard], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of ``entries`` in memory as (input_ids, labels, position_ids) int64 arrays (small sets only)."""
    rows = open_rows(cache, entries, seq_len)
    return rows.take(np.arange(len(rows)))


@dataclass
class Cursor:
    """Where a rank is in its data: ``pos`` rows into the permutation of ``epoch``."""

    epoch: int = 0
    pos: int = 0


class RankSampler:
    """Deterministic per-epoch order of one rank's rows; ``take`` advances a Cursor without touching skipped rows."""

    def __init__(self, num_rows: int, seed: int, rank: int):
        if num_rows == 0:
            raise ValueError(f"rank {rank} has no training rows")
        self.num_rows = num_rows
        self.seed = seed
        self.rank = rank
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch or self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.rank, epoch]).permutation(self.num_rows)
            self._epoch = epoch
        return self._perm

    def take(self, cursor: Cursor, k: int) -> tuple[np.ndarray, Cursor]:
        """The next ``k`` row indices from ``cursor`` (wrapping into the next epoch) and the advanced cursor."""
        idx, _, after = self.take_with_epochs(cursor, k)
        return idx, after

    def take_with_epochs(self, cursor: Cursor, k: int) -> tuple[np.ndarray, np.ndarray, Cursor]:
        """As :meth:`take`, with the epoch of each row."""
        out: list[np.ndarray] = []
        epochs: list[np.ndarray] = []
        epoch, pos = cursor.epoch, cursor.pos
        while k > 0:
            chunk = self.permutation(epoch)[pos : pos + k]
            out.append(chunk)
            epochs.append(np.full(len(chunk), epoch))
            k -= len(chunk)
            pos += len(chunk)
            if pos >= self.num_rows:
                epoch, pos = epoch + 1, 0
        return np.concatenate(out), np.concatenate(epochs), Cursor(epoch, pos)


class RowTracer(Protocol):
    def add(self, epochs: np.ndarray, ids: list[tuple[str, int]]) -> None: ...


@dataclass
class MicroBatch:
    """One micro-batch as a worker trains it: the rows read, their arrays as staged, which rows count (a row past
    ``train.epochs``' last pass does not) and the tokens of those."""

    v: int
    idx: np.ndarray
    rows: tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids, labels, position_ids (a preference pair's parts)
    keep: np.ndarray  # bool per row: trained (not past the last pass)
    tokens: int

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, position_ids), every label of a row that does not count ``IGNORE_INDEX``."""
        ids, labels, pos = self.rows
        return ids, np.where(self.keep[:, None], labels, IGNORE_INDEX), pos

    @property
    def learned(self) -> bool:
        """Any row of it trained (a micro-batch wholly past the last pass has no loss to take a mean of)."""
        return bool(self.keep.any())


def advance(cursor: Cursor, n: int, num_rows: int) -> Cursor:
    """``cursor`` moved ``n`` rows on (through epochs), without building the permutation."""
    pos = cursor.pos + n
    return Cursor(cursor.epoch + pos // num_rows, pos % num_rows)


def step_slots(data_ranks: int, grad_accum_steps: int, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The micro-batches worker ``rank`` of ``world_size`` runs each step, as (data rank, micro-batch index)."""
    per = data_ranks * grad_accum_steps // world_size
    return [divmod(s, grad_accum_steps) for s in range(rank * per, (rank + 1) * per)]


def served_data_ranks(slots: list[tuple[int, int]]) -> list[int]:
    """The data ranks a worker with these micro-batch slots (:func:`step_slots`) serves, in order."""
    return sorted({v for v, _ in slots})


class StepPlan:
    """Which rows this worker trains on at each step, the same rows per step at any world size (module docstring).

    ``cursors`` (one per data rank, the global cursor) advance together on every worker; a worker builds only its
    own micro-batches' rows, and memory-maps only the shards of the data ranks it serves."""

    def __init__(
        self,
        cache: ShardCache,
        entries: list[Shard],
        seq_len: int,
        *,
        data_ranks: int,
        grad_accum_steps: int,
        micro_batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        epochs: int | None = None,
        pad_id: int = 0,
    ):
        slots = data_ranks * grad_accum_steps
        if slots % world_size:
            raise ValueError(f"{slots} micro-batches per step cannot be split evenly over {world_size} workers")
        self.data_ranks, self.accum, self.micro = data_ranks, grad_accum_steps, micro_batch_size
        self.epochs, self.pad_id = epochs, pad_id
        self.slots = step_slots(data_ranks, grad_accum_steps, rank, world_size)
        self.entries = {v: rank_shards(entries, v, data_ranks) for v in range(data_ranks)}
        served = served_data_ranks(self.slots)
        self.rows = {v: open_rows(cache, self.entries[v], seq_len) for v in served}
        self.samplers = {v: RankSampler(len(self.rows[v]), seed, v) for v in served}
        self.num_rows = [self._count(v) for v in range(data_ranks)]

    def _count(self, v: int) -> int:
        if v in self.rows:
            return len(self.rows[v])
        return sum(e.rows for e in self.entries[v])  # a shard's row count: required by the manifest's model

    @property
    def micro_batches(self) -> int:
        """Micro-batches this worker runs per step (its gradient accumulation)."""
        return len(self.slots)

    def start(self) -> list[Cursor]:
        return [Cursor() for _ in range(self.data_ranks)]

    def batch(self, cursors: list[Cursor], k: int) -> tuple[int, np.ndarray, np.ndarray]:
        """This worker's ``k``-th micro-batch of the step that starts at ``cursors``: (data rank, row indices into
        that data rank's rows, the epoch of each row)."""
        v, a = self.slots[k]
        start = advance(cursors[v], a * self.micro, self.num_rows[v])
        idx, epochs, _ = self.samplers[v].take_with_epochs(start, self.micro)
        return v, idx, epochs

    def take(self, v: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.rows[v].take(idx)

    def micro_batch(self, cursors: list[Cursor], k: int, trace: RowTracer | None = None) -> MicroBatch:
        """This worker's ``k``-th micro-batch of the step at ``cursors``, read (:meth:`batch`, :meth:`take`), its
        trained rows traced. With ``epochs``, a row of a later pass is past the end: it is read (the batch keeps
        its shape) but masked from the loss, traced and counted nowhere -- every row is trained ``epochs`` times."""
        v, idx, epochs = self.batch(cursors, k)
        keep = np.ones(len(idx), dtype=bool) if self.epochs is None else epochs < self.epochs
        if trace is not None:
            trace.add(epochs[keep], self.identify(v, idx[keep]))
        rows = self.take(v, idx)
        return MicroBatch(v, idx, rows, keep, int((rows[0][keep] != self.pad_id).sum()))

    def after(self, cursors: list[Cursor]) -> list[Cursor]:
        """The global cursor after one step (every data rank moved ``accum x micro`` rows)."""
        n = self.accum * self.micro
        return [advance(c, n, self.num_rows[v]) for v, c in enumerate(cursors)]

    def identify(self, v: int, idx: np.ndarray) -> list[tuple[str, int]]:
        """(shard file, row in it) of data rank ``v``'s rows ``idx``: a row's identity at any world size."""
        rows = self.rows[v]
        part = np.searchsorted(rows.starts, idx, side="right") - 1
        return [(self.entries[v][k].file, int(i - rows.starts[k])) for k, i in zip(part, idx, strict=True)]
