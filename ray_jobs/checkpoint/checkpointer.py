"""The checkpointer: when this rank's checkpoint is taken, and how it is committed, deferred or abandoned.

The trainer calls it at every step boundary with what all ranks agreed (torchtitan's ``checkpointer.save(step)``):
:meth:`Checkpointer.commit` once every rank's part landed, :meth:`Checkpointer.save_if_due` for the step's
checkpoint. What a checkpoint holds is the trainer's (``snapshot``); the folder layout is :mod:`.format`'s.

One write is in flight at a time, committed in two stages that each end at a step boundary, so training never waits
on storage: every rank's part lands (the writer's thread), then rank 0 writes the manifest (the same thread), then
every rank reports the checkpoint to Ray. A checkpoint due while the previous write is still in flight is *owed*:
taken at the first step after that write landed. A write that failed on any rank is abandoned on every rank, and the
next step takes one. Every decision is taken from values all ranks share (the step's all-reduce, a gather, rank 0's
broadcast), so ranks never diverge into different collectives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ray_jobs.checkpoint.format import Part, checkpoint_name, write_manifest
from ray_jobs.checkpoint.writer import AsyncWriter
from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Phase
from ray_jobs.storage import join

log = logging.getLogger("unbroken.train")


# What the platform is told with a checkpoint: the step and the eval loss (``checkpoint.keep_best_by`` ranks by them;
# a search's scheduler decides on them). Numbers, or None before the first eval.
Reported = dict[str, float | None]


class Ranks(Protocol):
    """What the checkpointer needs of the runtime: who this rank is, two collectives, and Ray's report."""

    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def report(self, metrics: Reported, checkpoint_url: str | None) -> None: ...


class Checkpointer:
    """One rank's checkpoints: ``snapshot`` makes this rank's part (host copies), ``phase`` tells the heartbeat."""

    def __init__(
        self, cfg: Config, rt: Ranks, checkpoints_dir: str, snapshot: Callable[[], Part], phase: Callable[[Phase], None]
    ):
        self.cfg, self.rt, self.dir = cfg, rt, checkpoints_dir
        self.snapshot, self.phase = snapshot, phase
        self.fsdp = cfg.train.parallelism == "fsdp"
        self.writer = AsyncWriter()
        self.pending: tuple[int, Reported] | None = None  # started, not yet reported (known to all ranks)
        self.manifest_pending = False  # the parts landed; rank 0's manifest write is in flight
        self.owed = False  # one is due but waits for the previous write to land
        self.last_step = -1
        self.last_time = time.monotonic()
        self.stalls_s: list[float] = []  # training-thread time blocked per checkpoint

    def url(self, step: int) -> str:
        return join(self.dir, checkpoint_name(step))

    # -- what the step's all-reduce carries -------------------------------------------------------------------
    def time_due(self) -> bool:
        """Rank 0's clock says ``checkpoint.every_minutes`` passed (one clock: the ranks agree on rank 0's)."""
        every_min = self.cfg.checkpoint.every_minutes
        return self.rt.rank == 0 and every_min > 0 and time.monotonic() - self.last_time >= every_min * 60

    def write_done(self) -> bool:
        """This rank's part of the checkpoint in flight is on storage."""
        return self.pending is not None and self.writer.done()

    # -- taking one -----------------------------------------------------------------------------------------
    def save_if_due(self, step: int, last: bool, time_due: bool, metrics: Reported) -> float | None:
        """Take this step's checkpoint if one is due (``checkpoint.every_steps``, the agreed ``time_due``, or owed);
        the seconds training was blocked, or None when none was taken. The last step's is :meth:`finish`'s."""
        every = self.cfg.checkpoint.every_steps
        was_owed = self.owed
        self.owed |= not last and bool((every and step % every == 0) or time_due)
        if self.owed and self.pending is not None:
            # The previous write is still in flight (a slow or unavailable store): keep training and take this
            # checkpoint at the first step after it landed, instead of freezing every rank until it does. Every
            # rank knows: ``pending`` is cleared on all ranks together once rank 0 says the write is done.
            if not was_owed and self.rt.rank == 0:
                log.warning("checkpoint due at step %d deferred: the previous write is still in flight", step)
            return None
        if self.owed:
            return self.save(step, metrics, sync=not self.cfg.checkpoint.async_write)
        return None

    def save(self, step: int, metrics: Reported, sync: bool) -> float:
        """Snapshot state into host memory and hand it to the writer; returns the seconds training was blocked."""
        started = time.monotonic()
        if sync:
            self.phase("checkpointing")  # the training thread waits for the write: not a training step's time
        if self.pending is not None:  # at most one write in flight: finish (and report) the previous one first
            self.commit()
        self.writer.submit(self.snapshot(), self.url(step))  # every rank writes its part
        self.pending, self.manifest_pending = (step, metrics), False
        self.last_step, self.last_time, self.owed = step, time.monotonic(), False
        if sync:
            self.commit()
            self.phase("training")
        stall = time.monotonic() - started
        self.stalls_s.append(stall)
        return stall

    # -- committing it --------------------------------------------------------------------------------------
    def commit(self, report: bool = True, wait: bool = True) -> None:
        """Finish the checkpoint in flight, every rank together, in two stages that each end at a step boundary:
        once every rank's part landed, rank 0 writes the manifest (on the writer's thread: training never waits on
        storage); once that landed, all report the checkpoint to Ray. ``wait`` runs both stages now."""
        if not self.manifest_pending:
            self._parts_landed()
            if not (wait and self.manifest_pending):
                return
        self._manifest_landed(report)

    def _parts_landed(self) -> None:
        assert self.pending is not None, "commit() runs only while a checkpoint is in flight"
        step, _ = self.pending
        try:
            written = self.writer.collect()
        except Exception as e:  # this rank's part did not land: no rank may declare the checkpoint written
            log.warning("rank %d: checkpoint for step %d not written: %s: %s", self.rt.rank, step, type(e).__name__, e)
            written = None
        parts = self.rt.all_gather_object(written)
        if any(p is None for p in parts):
            self._abandon(step, "a rank's part failed")
            return
        if self.rt.rank == 0:
            self.writer.run(write_manifest, self.url(step), step, self.rt.world_size, self.fsdp, parts)
        self.manifest_pending = True

    def _manifest_landed(self, report: bool) -> None:
        assert self.pending is not None, "commit() runs only while a checkpoint is in flight"
        step, metrics = self.pending
        landed = True
        if self.rt.rank == 0:
            try:
                self.writer.collect()
                log.info("checkpoint for step %d written: %s", step, self.url(step))
            except Exception as e:  # the store refused the manifest: the checkpoint does not exist, on every rank
                log.warning("rank 0: manifest for step %d not written: %s: %s", step, type(e).__name__, e)
                landed = False
        if not self.rt.broadcast_object(landed):
            self._abandon(step, "its manifest could not be written")
            return
        self.pending, self.manifest_pending = None, False
        if report:
            self.rt.report(metrics, self.url(step) if self.rt.rank == 0 else None)

    def _abandon(self, step: int, why: str) -> None:
        log.warning("checkpoint for step %d abandoned (%s); the next step takes one", step, why)
        self.pending, self.manifest_pending, self.owed = None, False, True

    # -- the end --------------------------------------------------------------------------------------------
    def finish(self, step: int, metrics: Reported) -> None:
        """The last step is always checkpointed, synchronously, and every started write is reported."""
        if self.last_step != step:
            self.save(step, metrics, sync=True)
            if self.owed:  # abandoned (a store refused a write): the attempt fails, and is retried
                raise RuntimeError(f"the final checkpoint (step {step}) could not be written")
        elif self.pending is not None:
            self.commit()
        self.writer.close()

    def stop(self) -> None:
        """Stop as if the job died here: a write in flight completes (manifest and all), but is never reported."""
        if self.pending is not None:
            self.commit(report=False)
        self.writer.close()
