"""SIGTERM -> just-in-time checkpoint at the next step boundary, then exit (bounded by a grace period).

Ray Train runs the training function in a side thread of the worker process, while signal handlers belong to
the main thread -- which sits in Ray's C++ task loop and runs Python handlers only when it next runs Python,
possibly long after the signal. So a Torch backend hook (:func:`torch_config`) runs on each worker's main thread
and installs a handler *plus* a wakeup fd: CPython's C-level handler writes the signal number to a pipe at once,
and a watcher thread turns it into the flag the training loop checks at every step boundary (agreed across
ranks). The loop saves the checkpoint and raises :class:`Preempted` on every rank, so Ray Train restarts the
worker group, which resumes from that checkpoint: no step is lost or repeated. If no checkpoint comes within
the grace period (a hung loop), the process exits anyway, as SIGTERM demands.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ray_jobs.contracts.heartbeat import Phase
from ray_jobs.train.runtime import DrainNotice

log = logging.getLogger("unbroken.preemption")

_requested = threading.Event()
_saved = threading.Event()
_training = threading.Event()  # set only while the loop runs; outside it there is nothing to save
_triggered = threading.Lock()


def training(active: bool) -> None:
    """The loop marks when it is running (a SIGTERM outside it exits at once, as Ray's default would)."""
    (_training.set if active else _training.clear)()


def requested() -> bool:
    """True once this process got SIGTERM."""
    return _requested.is_set()


def checkpoint_saved() -> None:
    """The loop saved the just-in-time checkpoint."""
    _saved.set()


def _on_sigterm(grace_s: float) -> None:
    if not _training.is_set():
        log.warning("SIGTERM outside the training loop: exiting now (the last checkpoint is the resume point)")
        os._exit(1)
    _requested.set()
    log.warning("SIGTERM: saving a checkpoint at the next step boundary (grace %.0fs)", grace_s)
    if not _saved.wait(grace_s):
        log.error("SIGTERM: no checkpoint within %.0fs; exiting without one", grace_s)
        os._exit(1)
    # Saved: the loop raised Preempted and Ray Train is restarting the group, which ends this process. Should
    # it somehow linger, SIGTERM still means exit.
    time.sleep(grace_s)
    os._exit(1)


def _trigger(grace_s: float) -> None:
    """Start the SIGTERM response once, on its own thread: whoever notices the signal first must not block --
    least of all the main thread, which serves Ray Train's health polls (a blocked poll gets the group killed)."""
    if _triggered.acquire(blocking=False):
        threading.Thread(target=_on_sigterm, args=(grace_s,), name="unbroken-sigterm", daemon=True).start()


def _watch(read_fd: int, grace_s: float) -> None:
    while True:
        if signal.SIGTERM in os.read(read_fd, 64):
            _trigger(grace_s)


def install_sigterm_handler(grace_s: float) -> None:
    """Must run on the main thread. Replaces Ray's SIGTERM handler with a checkpoint-first one."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: _trigger(grace_s))
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        log.warning("replaced an existing signal wakeup fd (%d)", previous)
    threading.Thread(target=_watch, args=(read_fd, grace_s), name="unbroken-signal-watch", daemon=True).start()


class Preempted(RuntimeError):
    """Raised on every rank after a just-in-time checkpoint, so Ray Train restarts the group from it."""


def torch_config(use_gpu: bool, grace_s: float, live: dict[str, Any] | None = None):
    """A TorchConfig whose backend also installs the SIGTERM handler on every worker. ``live``: the torchft
    lighthouse's settings -- each worker a replica group (Ray Train's ``TorchftConfig``), replaced alone."""
    from ray.train.torch import TorchConfig

    from ray_jobs.ray_private import torch_backend, torchft_backend

    if live is not None:
        return _torchft_config(torchft_backend(), use_gpu, grace_s, live)

    class _Backend(torch_backend()):
        def on_start(self, worker_group, backend_config):
            super().on_start(worker_group, backend_config)
            worker_group.execute(install_sigterm_handler, grace_s=backend_config.preemption_grace_s)

    @dataclass
    class UnbrokenTorchConfig(TorchConfig):
        preemption_grace_s: float = 30.0

        @property
        def backend_cls(self):
            return _Backend

    return UnbrokenTorchConfig(backend="nccl" if use_gpu else "gloo", preemption_grace_s=grace_s)


def _torchft_config(backend: type[Any], use_gpu: bool, grace_s: float, lighthouse: dict[str, Any]):
    from ray.train.v2.torch.torchft_config import TorchftConfig

    class _Backend(backend):
        def on_start(self, worker_group, backend_config):  # the whole group, or one replica group replacing one
            super().on_start(worker_group, backend_config)
            worker_group.execute(install_sigterm_handler, grace_s=backend_config.preemption_grace_s)

    class UnbrokenTorchftConfig(TorchftConfig):
        def __init__(self, **kwargs):
            self.preemption_grace_s = grace_s
            super().__init__(**kwargs)

        @property
        def backend_cls(self):
            return _Backend

    return UnbrokenTorchftConfig(lighthouse_kwargs=lighthouse, backend="nccl" if use_gpu else "gloo")


# The loop's own messages, logged as the training loop's (log readers and tests look for them there).
train_log = logging.getLogger("unbroken.train")


def checkpoint_and_raise(checkpoint: Callable[[], float], rank: int, step: int) -> NoReturn:
    """A rank got SIGTERM (agreed by every rank): a just-in-time checkpoint, then :class:`Preempted` on every rank,
    so Ray Train restarts the group from it."""
    checkpoint()
    train_log.warning("rank %d: just-in-time checkpoint at step %d saved (preemption)", rank, step)
    checkpoint_saved()
    raise Preempted(f"preempted: just-in-time checkpoint at step {step} saved")


def checkpoint_and_wait(
    notice: DrainNotice,
    checkpoint: Callable[[], float],
    rank: int,
    step: int,
    grace_s: float,
    phase: Callable[[Phase], None],
) -> None:
    """A node of this group is being drained (a spot reclaim, ``ray drain-node``): checkpoint this step now, on
    every rank, then wait for Ray Train to restart the group without that node.

    Ray Train restarts once the drain deadline passes (or 120 s after the notice, without one) and counts it
    against ``FailureConfig.max_preemption_failures``, not ``max_failures``. It must be waited for, not forced:
    a rank that raised would count as a failure, one that returned as the run's success. Training on would only
    make steps that the restart throws away; waiting loses none."""
    checkpoint()
    deadline = drain_deadline(notice)
    train_log.warning(
        "rank %d: just-in-time checkpoint at step %d saved (drain notice for node(s) %s, deadline in "
        "%.0f s); waiting for Ray Train to restart the group",
        rank,
        step,
        ", ".join(n[:12] for n in notice.nodes),
        deadline - time.time(),
    )
    phase("preempted")
    wait_for_restart(deadline, grace_s)
    # Still here long past the deadline: the drain went nowhere. Carry on rather than idle for ever.
    train_log.warning("rank %d: no restart %.0f s past the drain deadline; training on", rank, grace_s + 60)
    phase("training")


def drain_deadline(notice: DrainNotice) -> float:
    """When a drained node goes (epoch seconds): the notice's deadline, or 120 s from now without one (Ray Train's
    own wait then)."""
    return notice.deadline_ms / 1000 if notice.deadline_ms else time.time() + 120


def wait_for_restart(deadline: float, grace_s: float) -> None:
    """Wait for Ray Train to restart the group after a drain notice (this process is stopped then); returns only
    long past the deadline, when the drain went nowhere."""
    give_up = deadline + grace_s + 60
    while time.time() < give_up:
        time.sleep(0.5)
