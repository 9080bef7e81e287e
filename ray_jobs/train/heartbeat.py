"""Rank 0's heartbeat file: liveness, progress and phase, for watchers outside the job."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat, Phase
from ray_jobs.errors import user_error
from ray_jobs.storage import Layout, write_json_atomic
from ray_jobs.train.sidewrite import SideWriter


class Heartbeat:
    """Rank 0 refreshes ``runs/<run>/heartbeat.json`` every few seconds from a side thread, and at once on every
    phase change. Training never waits for it: a storage outage delays the file, and it catches up after.

    ``time`` says the process is alive; ``step`` and ``last_step_at`` say whether training moves; ``phase`` and
    ``phase_started_at`` say what it is doing otherwise (a multi-GB export is not a hang). A watcher tells a hang
    (fresh ``time``, nothing moving for the phase's limit) from slow progress from a dead or frozen process (old
    ``time``). It starts before the model is loaded, so loading shows as ``loading``, not as silence.
    """

    def __init__(self, url: str, every_s: float, run: str, max_steps: int, attempt: int):
        self.url, self.every_s, self.run, self.max_steps, self.attempt = url, every_s, run, max_steps, attempt
        self.trainer: Any = None  # what it reports on, once built (attach)
        self.started_at = time.time()
        self.phase: Phase = "loading"
        self.phase_started_at = self.started_at
        self.writes: Any = lambda: True  # live recovery: only the replica that leads writes (train/live_trainer.py)
        self._writer = SideWriter(self.beat, "unbroken-heartbeat", every_s=every_s)

    def start(self) -> Heartbeat:
        self._writer.start().poke()
        return self

    def attach(self, trainer: Any) -> None:
        self.trainer = trainer

    def enter(self, phase: Phase) -> None:
        """The job moves to ``phase``: the side thread writes it at once, not at the next periodic beat."""
        if phase == self.phase:
            return
        self.phase, self.phase_started_at = phase, time.time()
        self._writer.poke()

    def state(self) -> Beat:
        t = self.trainer
        return Beat(
            schema_version=Beat.SCHEMA,
            run=self.run,
            step=t.loop.step if t else 0,
            max_steps=self.max_steps,
            last_step_at=t.last_step_at if t else self.started_at,
            attempt=self.attempt,
            started_step=t.started_step if t else 0,
            first_step_at=t.first_step_at if t else None,
            phase=self.phase,
            phase_started_at=self.phase_started_at,
            time=time.time(),
            tokens_per_s=t.throughput.tokens_per_s if t else 0.0,
            pid=os.getpid(),
            host=socket.gethostname(),
            **(t.live_state() if hasattr(t, "live_state") else {}),
        )

    def beat(self) -> None:
        if self.writes():
            write_json_atomic(self.url, self.state().dump())

    def stop(self, timeout_s: float = 10.0) -> None:
        """The last state written (bounded wait: a job ending while storage is away is not held up for long)."""
        self._writer.close(timeout_s)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_heartbeat(cfg: Config, attempt: int, writes: Any = None) -> Heartbeat:
    """Rank 0's heartbeat, started now (phase ``loading``); ``writes``: when it may write (default: always)."""
    url = Layout(cfg.storage).heartbeat(cfg.name)
    beat = Heartbeat(url, cfg.fault_tolerance.heartbeat_every_s, cfg.name, cfg.train.max_steps, attempt)
    if writes is not None:
        beat.writes = writes
    return beat.start()


def group_restarts(cfg: Config):
    """The Ray Train callback that says so in the heartbeat when the worker group fails (:class:`GroupRestarts`)."""
    from ray.train import UserCallback

    class GroupRestarts(UserCallback):
        """Ray Train's controller calls ``after_exception`` when a worker of the group raised or died; Ray Train then
        restarts the group inside the job (``fault_tolerance.max_failures``). Until the new rank 0 beats, nothing
        writes the heartbeat -- and a group of slow starters (a DPO trainer with its reference model, on a loaded
        host) can take longer than ``stall_timeout_s`` to be back: a watcher would take the restart in progress for
        a dead job and restart it a second time. So the controller writes phase ``restarting`` into the heartbeat,
        which a watcher judges by ``phase_stall_s.starting`` instead -- unless a worker failed on the user's mistake,
        which no restart follows. Best effort: a storage that fails this write only leaves the heartbeat as it
        was."""

        def __init__(self, url: str):
            self.url = url

        def after_exception(self, run_context, worker_exceptions) -> None:
            if any(user_error(e) is not None for e in worker_exceptions.values()):
                return  # a user's mistake: no restart comes (ray_private.no_retry_of_user_errors)
            try:
                beat = Beat.read(self.url)
                if beat is None or beat.phase == "done":
                    return
                now = time.time()
                beat.set(phase="restarting", phase_started_at=now, time=now, pid=os.getpid(), host=socket.gethostname())
                write_json_atomic(self.url, beat.dump())
            except Exception as e:  # noqa: BLE001 (never a reason to fail Ray Train's controller)
                logging.getLogger("unbroken.train").warning("heartbeat: could not record the restart: %s", e)

    return GroupRestarts(Layout(cfg.storage).heartbeat(cfg.name))
