"""``runs/<run>/heartbeat.json``: what a job says of itself to watchers outside it -- alive (``time``), moving (``step``,
``last_step_at``), in which phase and since when. Written by rank 0 (ray_jobs/train/heartbeat.py), by a search's
driver from its trials' (ray_jobs/search/progress.py) and, once, by Ray Train's controller when it restarts the
group; read by the watchdog (control/watchdog/observe.py), the flow's watch and progress line, and ``status``.
One model for every writer and reader: a field one side renames fails the other's tests, not a watchdog at 3 a.m."""

from __future__ import annotations

from typing import Literal, TypedDict

from ray_jobs.contracts.base import Part, Record

# What a job does, in order. ``starting`` (submitted, no heartbeat yet) is what a watcher infers; the job never
# writes it. ``training`` is judged by steps; every other phase by the time spent in it. ``preempted``: checkpointed
# for a node's drain notice, waiting for Ray Train to restart the group. ``restarting``: a worker of the group failed
# and Ray Train restarts the group inside the job (written by its controller: ray_jobs/train/heartbeat.GroupRestarts).
Phase = Literal["loading", "evaluating", "training", "checkpointing", "preempted", "restarting", "exporting", "done"]


class Heal(Part):
    """One live-recovery heal: replica ``rank`` took the live state of a peer at ``step`` (ray_jobs/train/live.py)."""

    rank: int
    step: int
    at: float
    heal_s: float = 0.0
    lost_steps: int = 0
    source: str | None = None


class LiveFields(TypedDict):
    """The heartbeat's live-recovery fields as a live trainer reports them (``Beat``'s fields of the same names)."""

    replicas: int
    participants: int
    standby: int
    healing: bool
    heals: int
    last_heal: Heal | None


class Beat(Record):
    """One heartbeat. ``attempt`` says whose it is (an older attempt's says nothing about the current one); a search's
    names no process (``pid``, ``host``: its trials' ranks beat for it); the live-recovery fields are there only
    when ``fault_tolerance.live_recovery`` is on."""

    run: str
    attempt: int
    time: float  # when it was written, by the writer's clock
    max_steps: int
    step: int = 0
    started_step: int = 0  # the step this process resumed from (0: from the start)
    last_step_at: float  # when the newest step was committed (the process's start before the first)
    first_step_at: float | None = None  # when this process committed its first step (None: not yet)
    phase: Phase | None = None  # None: a heartbeat from before phases were written (judged as training)
    phase_started_at: float | None = None
    tokens_per_s: float = 0.0
    pid: int | None = None
    host: str | None = None
    # live recovery (ray_jobs/train/live_trainer.py): replicas, who took part in the last step, standbys, heals
    replicas: int | None = None
    participants: int | None = None
    standby: int | None = None
    healing: bool | None = None
    heals: int = 0
    last_heal: Heal | None = None

    @property
    def judged_phase(self) -> Phase:
        """The phase a watcher judges it by: its own, or ``training`` for an older heartbeat that wrote none."""
        return self.phase or "training"
