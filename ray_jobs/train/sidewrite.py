"""Small files the job keeps on storage (heartbeat, metrics), written from a side thread.

Training must not wait on storage: an S3 endpoint throttled or away for 30 s would otherwise freeze every rank at
the next log line (object stores cannot append, so a metrics write is a whole-file PUT) and make a healthy job look
hung. Neither Ray Train nor fsspec offers a "write the newest version in the background, retry until it lands"
for an object that keeps changing, so this is written by hand. Checkpoints are not written this way: they have
their own writer (one snapshot in flight, reported to Ray Train only once it is on storage).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("unbroken.storage")


class SideWriter:
    """Calls ``write`` (which writes the object's *current* content) on a side thread whenever :meth:`poke` says
    something changed, and every ``every_s`` seconds if given. A failed or slow write never reaches the caller: it
    is logged and retried after ``retry_s``, and the retry carries whatever is newest by then, so the file catches
    up once storage answers again. :meth:`flush` waits (bounded) until everything poked so far is written."""

    def __init__(self, write: Callable[[], None], name: str, every_s: float | None = None, retry_s: float = 1.0):
        self._write, self.name, self.every_s, self.retry_s = write, name, every_s, retry_s
        self._cond = threading.Condition()
        self._wanted = self._done = 0  # generations: poked vs written
        self._stopping = False
        self.failures = 0  # consecutive failed writes (0 once one lands)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> SideWriter:
        self._thread.start()
        return self

    def poke(self) -> int:
        """The content changed: write it soon. Returns the generation :meth:`flush` waits for."""
        with self._cond:
            self._wanted += 1
            self._cond.notify_all()
            return self._wanted

    def flush(self, timeout_s: float) -> bool:
        """Write now and wait until it landed; False if it did not within ``timeout_s`` (it keeps trying)."""
        target = self.poke()
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= target, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Flush (bounded), then stop the thread. Returns whether the last content landed."""
        landed = self.flush(timeout_s) if self._thread.is_alive() else False
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=max(self.retry_s, 1.0) + 5)
        return landed

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._wanted > self._done, self.every_s)
                if self._stopping:
                    return
                target = self._wanted
            if self._attempt():
                with self._cond:
                    self._done = max(self._done, target)
                    self._cond.notify_all()
            else:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, self.retry_s)

    def _attempt(self) -> bool:
        try:
            self._write()
        except Exception as e:  # storage trouble (an S3 timeout, a 503): retried, never raised into training
            self.failures += 1
            if self.failures == 1 or self.failures % 30 == 0:
                log.warning("%s: write failed %d time(s) in a row, retrying: %s", self.name, self.failures, e)
            return False
        if self.failures:
            log.warning("%s: write landed again after %d failure(s)", self.name, self.failures)
        self.failures = 0
        return True
