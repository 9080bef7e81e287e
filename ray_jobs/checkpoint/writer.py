"""Background checkpoint writes: the training thread hands over a host-memory snapshot; one write in flight."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ray_jobs.checkpoint.format import Snapshot, write


class AsyncWriter:
    """Writes snapshots on a background thread, one at a time; the trainer learns of completion via ``done()``."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-ckpt")
        self._inflight: tuple[Snapshot, str, Future] | None = None

    def submit(self, snap: Snapshot, url: str) -> None:
        if self._inflight is not None:
            raise RuntimeError("a checkpoint write is already in flight; collect it first")
        self._inflight = (snap, url, self._pool.submit(write, snap, url))

    def done(self) -> bool:
        return self._inflight is not None and self._inflight[2].done()

    def collect(self) -> tuple[Snapshot, str] | None:
        """Wait for the write in flight (if any); returns (snapshot, url) once it is on storage."""
        if self._inflight is None:
            return None
        snap, url, fut = self._inflight
        self._inflight = None
        fut.result()  # re-raise a failed write here, on the training thread
        return snap, url

    def close(self) -> None:
        self._pool.shutdown(wait=True)
