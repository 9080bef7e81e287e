"""SIGTERM -> just-in-time checkpoint at the next step boundary, then exit (bounded by a grace period).

Ray Train runs the training function in a side thread of the worker process, while signal handlers live on the
main thread. A Torch backend hook (:class:`UnbrokenTorchConfig`) runs on each worker's main thread and installs
the handler. The handler raises a flag the training loop checks at every step boundary (agreed across ranks),
then waits until the loop has saved the checkpoint -- or the grace period ran out -- and exits the process as
Ray's own SIGTERM handler would. Ray Train then restarts the worker group (FailureConfig), which resumes from
that checkpoint: no step is lost or repeated.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("unbroken.preemption")

_requested = threading.Event()
_saved = threading.Event()


def requested() -> bool:
    """True once this process got SIGTERM."""
    return _requested.is_set()


def checkpoint_saved() -> None:
    """The loop saved the just-in-time checkpoint: the process may exit now."""
    _saved.set()


def install_sigterm_handler(grace_s: float) -> None:
    """Must run on the main thread. Replaces Ray's SIGTERM handler with a checkpoint-first one."""

    def handler(signum, frame):
        started = time.monotonic()
        _requested.set()
        log.warning("SIGTERM: saving a checkpoint at the next step boundary (grace %.0fs)", grace_s)
        saved = _saved.wait(grace_s)
        log.warning(
            "SIGTERM: %s after %.1fs; exiting",
            "checkpoint saved" if saved else "grace period over without a checkpoint",
            time.monotonic() - started,
        )
        from ray._private.worker import raise_sys_exit_with_custom_error_message

        raise_sys_exit_with_custom_error_message("The process received a SIGTERM (preempted).", exit_code=1)

    signal.signal(signal.SIGTERM, handler)


class Preempted(RuntimeError):
    """Raised on every rank after a just-in-time checkpoint, so Ray Train restarts the group from it."""


def torch_config(use_gpu: bool, grace_s: float):
    """A TorchConfig whose backend also installs the SIGTERM handler on every worker."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class _Backend(_TorchBackend):
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
