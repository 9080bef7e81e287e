"""The run's metrics log on storage, written in O(new rows) and read incrementally.

On a file system it is ``runs/<run>/metrics.jsonl``, appended to. Object stores cannot append, and rewriting the
whole file at every logged step is quadratic in run length, so there the log is a folder of immutable segments
``runs/<run>/metrics/g<generation>-keep<step>-<seq>.jsonl``: each write PUTs only the rows that are new. A resume
starts a new generation whose name says which earlier rows still count (steps below ``keep``), so readers see the
same consistent run a rewrite would have left, and no segment is ever changed. :class:`MetricsTail` reads only
what is new since its last look (a segment once, or the bytes past its offset).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from typing import TYPE_CHECKING

from ray_jobs.contracts.metrics import MetricsRow
from ray_jobs.storage import fs_and_path, is_local, join, listing, read_bytes, write_bytes_atomic
from ray_jobs.train.sidewrite import SideWriter

if TYPE_CHECKING:
    from ray_jobs.checkpoint.state import LoopState

_SEGMENT = re.compile(r"g(\d{6})-keep(\d{9})-(\d{6})\.jsonl$")


def segments_dir(url: str) -> str:
    """The object-store form of ``.../metrics.jsonl``: the folder ``.../metrics/`` of segments."""
    return url.removesuffix(".jsonl")


def _parse(data: bytes) -> list[MetricsRow]:
    rows = []
    for line in data.decode().splitlines():
        with contextlib.suppress(ValueError):  # a half-written last line (a writer mid-append) is not a row yet
            rows.append(json.loads(line))
    return rows


def _segments(url: str) -> list[tuple[tuple[int, int], int, str]]:
    """((generation, seq), keep, url) of every segment, in write order."""
    found = []
    for name in listing(segments_dir(url)):
        m = _SEGMENT.search(name)
        if m:
            found.append(((int(m.group(1)), int(m.group(3))), int(m.group(2)), join(segments_dir(url), m.group(0))))
    return sorted(found)


class MetricsTail:
    """The log's rows, read incrementally: each ``poll`` reads only segments (or bytes) it has not read before."""

    def __init__(self, url: str):
        self.url, self.local = url, is_local(url)
        self.rows: list[MetricsRow] = []
        self._seen: set[str] = set()
        self._generation = -1
        self._offset = 0
        self._inode = None
        self.bytes_read = 0

    def poll(self) -> list[MetricsRow]:
        """Every row so far (updated in place from what is new)."""
        if self.local:
            self._poll_file()
        else:
            self._poll_segments()
        return self.rows

    def last_step(self) -> int:
        self.poll()
        return int(self.rows[-1]["step"]) if self.rows else 0

    def _poll_file(self) -> None:
        fs, path = fs_and_path(self.url)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return
        size, inode = info["size"], info.get("ino")
        if size < self._offset or inode != self._inode:  # replaced (a resume rewrites it): read it from the start
            self.rows, self._offset, self._inode = [], 0, inode
        with fs.open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        whole = data[: data.rfind(b"\n") + 1]  # a line still being appended waits for the next look
        self._offset += len(whole)
        self.bytes_read += len(whole)
        self.rows += _parse(whole)

    def _poll_segments(self) -> None:
        for (generation, _), keep, url in _segments(self.url):
            if url in self._seen or generation < self._generation:  # a stale writer's late segment: not this run
                continue
            if generation != self._generation:  # a resume: rows from its step on were trained again
                self.rows = [r for r in self.rows if r["step"] < keep]
                self._generation = generation
            data = read_bytes(url)
            self.bytes_read += len(data)
            self.rows += _parse(data)
            self._seen.add(url)


def read_rows(url: str) -> list[MetricsRow]:
    """Every row of a run's metrics log (either form)."""
    return MetricsTail(url).poll()


class MetricsLog:
    """The metrics log, written by rank 0: one JSON line per logged step.

    After a resume, rows past the resumed step no longer count, so the log always describes one consistent run;
    a fresh start (``resumed_step`` None) starts an empty log. Rows are kept in memory and written from a side
    thread (:class:`SideWriter`): a slow or unavailable store delays the log, never a training step, and the log
    catches up when the store answers again.
    """

    def __init__(self, url: str, resumed_step: int | None):
        self.url, self.local = url, is_local(url)
        self.rows: list[MetricsRow] = []
        if resumed_step is not None:
            self.rows = [r for r in read_rows(url) if r["step"] <= resumed_step]
        self._lock = threading.Lock()
        self._rewrite = True  # a file: the first write replaces whatever it held
        if not self.local:  # segments: a new generation keeping the rows up to the resumed step
            earlier = _segments(url)
            self._generation = (earlier[-1][0][0] + 1) if earlier else 0
            self._keep = resumed_step + 1 if resumed_step is not None else 0
            self._seq = 0
            self._segment: tuple[int, bytes] | None = None  # (rows it covers, body) of a segment being written
        self._written = 0 if self.local else len(self.rows)  # rows[:_written] are on storage
        self.bytes_written = 0
        self._writer = SideWriter(self._write, "unbroken-metrics").start()
        self._writer.poke()
        self.trackers = None  # the run's experiment trackers (``tracking.Trackers``), fed each row too

    def append(self, row: MetricsRow) -> None:
        with self._lock:
            self.rows.append(row)
        self._writer.poke()
        if self.trackers is not None:
            self.trackers.log(row)

    def flush(self, timeout_s: float = 120.0) -> bool:
        """Wait (bounded) until every row so far is on storage; False if the store did not take them in time."""
        return self._writer.flush(timeout_s)

    def _write(self) -> None:
        with self._lock:
            rows, start = list(self.rows), self._written
        if self.local:
            self._write_file(rows, start)
            self._written = len(rows)
            return
        # A segment once tried keeps its body: a PUT that landed but reported failure is retried as it was (a
        # reader may have read it); rows that came meanwhile go into the next one, in this same call.
        while self._segment is not None or len(rows) > self._written or self._seq == 0:  # the first even if empty
            if self._segment is None:
                body = "".join(json.dumps(r) + "\n" for r in rows[self._written :]).encode()
                self._segment = (len(rows), body)
            upto, body = self._segment
            name = f"g{self._generation:06d}-keep{self._keep:09d}-{self._seq:06d}.jsonl"
            write_bytes_atomic(join(segments_dir(self.url), name), body)
            self.bytes_written += len(body)
            self._seq, self._written, self._segment = self._seq + 1, upto, None

    def _write_file(self, rows: list[MetricsRow], start: int) -> None:
        append, self._rewrite = not self._rewrite, True  # a failed append: rewrite next time
        if append:
            body = "".join(json.dumps(r) + "\n" for r in rows[start:])
            with open(self.url, "a") as f:
                f.write(body)
        else:
            body = "".join(json.dumps(r) + "\n" for r in rows)
            write_bytes_atomic(self.url, body.encode())
        self.bytes_written += len(body)
        self._rewrite = False


class Throughput:
    """Tokens per second over the window since the last logged row (what the heartbeat shows, too)."""

    def __init__(self) -> None:
        self._window = (time.monotonic(), 0)
        self.tokens_per_s = 0.0

    def restart(self, tokens_seen: int) -> None:
        self._window = (time.monotonic(), tokens_seen)

    def row(self, loop: LoopState) -> MetricsRow:
        """The logged row's throughput columns for ``loop`` (a ``LoopState``); starts the next window."""
        now = time.monotonic()
        t0, tok0 = self._window
        self._window = (now, loop.tokens_seen)
        self.tokens_per_s = round((loop.tokens_seen - tok0) / max(now - t0, 1e-9), 1)
        return {"tokens_seen": loop.tokens_seen, "tokens_per_s": self.tokens_per_s, "elapsed_s": loop.elapsed_s}
