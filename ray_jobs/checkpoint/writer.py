"""Background checkpoint writes: the training thread hands over this rank's part in host memory; one write in flight.

Every rank runs one: ranks write their own files in parallel, and serializing, hashing and uploading all happen on
this thread, so the training thread only pays for the device-to-host copy.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ray_jobs.checkpoint.format import Part, write_part


class AsyncWriter:
    """Writes parts on a background thread, one at a time; the trainer learns of completion via ``done()``."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-ckpt")
        self._inflight: tuple[str, Future] | None = None

    def submit(self, part: Part, url: str) -> None:
        self.run(write_part, part, url)

    def run(self, fn, *args: Any) -> None:
        """Any storage write of a checkpoint on this thread (rank 0's manifest too: training never waits on it)."""
        if self._inflight is not None:
            raise RuntimeError("a checkpoint write is already in flight; collect it first")
        self._inflight = ("", self._pool.submit(fn, *args))

    def done(self) -> bool:
        """Whether nothing is being written (the write in flight, if any, has finished)."""
        return self._inflight is None or self._inflight[1].done()

    def collect(self) -> Any:
        """Wait for the write in flight (if any); what it returned (a part: the size and sha256 of each file)."""
        if self._inflight is None:
            return {}
        _, fut = self._inflight
        self._inflight = None
        return fut.result()  # re-raise a failed write here, on the training thread

    def close(self) -> None:
        self._pool.shutdown(wait=True)
