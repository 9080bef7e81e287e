"""The step agreement: what every rank decides after a step, taken from one small all-reduce.

Ranks must take the same decisions at the same step (checkpoint now, report a finished write, stop for a
preemption), or their collectives would deadlock. Each step therefore ends with one small all-reduce of the loss,
the token count and three flags; every decision is taken from that agreed vector only."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ray_jobs.checkpoint.checkpointer import Checkpointer
from ray_jobs.train import preemption
from ray_jobs.train.runtime import DrainNotice, Runtime


@dataclass
class Agreed:
    """One step's outcome as every rank sees it (the result of the per-step all-reduce)."""

    loss: float
    tokens: int
    grad_norm: float  # this rank's (identical on every rank after the gradient all-reduce)
    write_done: bool
    time_due: bool
    preempt: bool  # a rank got SIGTERM
    notice: DrainNotice | None = None  # Ray Train's drain notice for a node of this group (when polled)


def agree(
    rt: Runtime, checkpointer: Checkpointer, poll_s: float, last_poll: float, loss, tokens: int, grad_norm
) -> tuple[Agreed, float]:
    """Every rank's step outcome, agreed with one small all-reduce; the step's only wait for the device. Rank 0 asks
    for a drain notice when ``poll_s`` passed since ``last_poll`` (monotonic); returned with when it last asked."""
    loss, grad_norm = float(loss), float(grad_norm)
    rank0 = rt.rank == 0
    time_due = checkpointer.time_due()
    write_done = checkpointer.write_done()  # this rank's part is on storage
    poll_due = rank0 and time.monotonic() - last_poll >= poll_s
    flags = [float(write_done), float(time_due), float(preemption.requested()), float(poll_due)]
    v = rt.all_reduce_sum([loss, tokens, *flags])
    notice = None
    if v[5] > 0:  # Ray Train's notice is itself a barrier: asked only every preemption_poll_s, by every rank
        last_poll = time.monotonic()
        notice = rt.preemption_notice()
    every_part = v[2] >= rt.world_size
    return Agreed(v[0] / rt.world_size, int(v[1]), grad_norm, every_part, v[3] > 0, v[4] > 0, notice), last_poll
