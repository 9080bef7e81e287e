"""Progress of long work (staging, the node-cache warm-up, the final export), throttled by time.

A :class:`Reporter` takes ``update(done, total, **counts)`` as often as the work likes and speaks at most every
``every_s`` (``UNBROKEN_PROGRESS_S``, default 5 s): on a terminal a one-line bar rewritten in place, otherwise a log
line -- done of total, percent, the counts (records), the rate (MB/s) and the counts' rates (tokens/s), an ETA. Each
time it speaks it also hands a :class:`Snapshot` to ``on_update`` (a Prefect progress artifact, a JSON file the flow
polls); a failing callback is logged and never fails the work. Rates and the ETA count from the first update, so a
resumed piece of work (staging from its spill) is timed by what it does now, not by what was done before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TextIO, TypedDict

from ray_jobs.poll import repeating

_log = logging.getLogger("unbroken.progress")

EVERY_S = 5.0  # between two progress lines (UNBROKEN_PROGRESS_S overrides)
BAR_EVERY_S = 0.5  # between two redraws of a terminal's bar
BAR_WIDTH = 24


def every_s() -> float:
    """Seconds between two progress lines: ``UNBROKEN_PROGRESS_S``, else 5."""
    try:
        return max(0.0, float(os.environ.get("UNBROKEN_PROGRESS_S", EVERY_S)))
    except ValueError:
        return EVERY_S


class SnapshotJson(TypedDict):
    """A snapshot as a staging job on the cluster writes it for the flow (``<submission>.progress.json``)."""

    what: str
    done: float
    total: float | None
    unit: str
    elapsed_s: float
    rate: float | None
    counts: dict[str, float]
    rates: dict[str, float | None]
    final: bool
    note: str
    percent: float | None
    eta_s: float | None
    line: str
    at: float  # when it was written


@dataclass(frozen=True)
class Snapshot:
    """Where the work is: ``done`` of ``total`` ``unit`` (None: not known), counts so far and their rates."""

    what: str
    done: float
    total: float | None
    unit: str = "B"
    elapsed_s: float = 0.0
    rate: float | None = None  # units per second since the first update
    counts: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float | None] = field(default_factory=dict)  # per second since the first update, of some counts
    final: bool = False
    note: str = ""  # said after the amount (training: its loss and time so far)

    @property
    def percent(self) -> float | None:
        if self.total is None:
            return None
        if self.total <= 0:
            return 100.0 if self.final else 0.0
        return min(100.0, 100.0 * self.done / self.total)

    @property
    def eta_s(self) -> float | None:
        if self.final or self.total is None or not self.rate or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)

    def line(self, bar: bool = False) -> str:
        """``what: 31% (32.5 MB of 105.2 MB), 31,800 records, 6.4 MB/s, 1.9 M tokens/s, ETA 11s``."""
        pct = self.percent
        amount = _amount(self.done, self.unit) + ("" if self.total is None else f" of {_amount(self.total, self.unit)}")
        head = f"{self.what}: " + (f"{pct:.0f}% ({amount})" if pct is not None else amount)
        if bar and pct is not None:
            full = round(BAR_WIDTH * pct / 100)
            head = f"{self.what} [{'#' * full}{'.' * (BAR_WIDTH - full)}] {pct:.0f}% ({amount})"
        parts = [
            head,
            *([self.note] if self.note else []),
            *(f"{_number(v)} {k}" for k, v in self.counts.items() if k not in self.rates),
        ]
        parts[-1] += f" in {duration(self.elapsed_s)}" if self.final else ""
        if self.rate is not None:
            parts.append(f"{_amount(self.rate, self.unit)}/s")
        parts += [f"{_number(v)} {k}/s" for k, v in self.rates.items() if v is not None]
        if (eta := self.eta_s) is not None:
            parts.append(f"ETA {duration(eta)}")
        return ", ".join(parts)

    def to_json(self) -> SnapshotJson:
        return {
            "what": self.what,
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            "elapsed_s": self.elapsed_s,
            "rate": self.rate,
            "counts": self.counts,
            "rates": self.rates,
            "final": self.final,
            "note": self.note,
            "percent": self.percent,
            "eta_s": self.eta_s,
            "line": self.line(),
            "at": time.time(),
        }


class Reporter:
    """Throttled progress of one piece of work (see the module's doc). ``quiet_s``: say nothing before the work
    has run this long (work that is usually quick stays silent); ``rates``: counts shown as per-second rates;
    ``tty``: draw a bar on ``stream`` (None: when it is a terminal); ``log``: where lines go otherwise."""

    def __init__(
        self,
        what: str,
        total: float | None = None,
        unit: str = "B",
        *,
        every: float | None = None,
        quiet_s: float = 0.0,
        rates: tuple[str, ...] = (),
        log: logging.Logger | logging.LoggerAdapter | None = None,
        on_update: Callable[[Snapshot], None] | None = None,
        tty: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit, self.rate_keys = what, total, unit, rates
        self.every_s = every_s() if every is None else every
        self.quiet_s, self.on_update, self.clock = quiet_s, on_update, clock
        self.log = log or _log
        self.stream = stream or sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.start: tuple[float, float, dict[str, float]] | None = None  # (time, done, counts) of the first update
        self.last: Snapshot | None = None
        self.spoke_at: float | None = None  # when the last line (or callback) went out
        self.drawn_at: float | None = None  # when the bar was last drawn
        self.note = ""  # said with every snapshot from now on (Snapshot.note)

    def update(self, done: float, total: float | None = None, **counts: float) -> None:
        now = self.clock()
        if total is not None:
            self.total = total
        if self.start is None:
            self.start = (now, done, dict(counts))
        self.last = self._snapshot(now, done, counts, final=False)
        if now - self.start[0] < self.quiet_s:
            return
        if self.spoke_at is None or now - self.spoke_at >= self.every_s:
            self.spoke_at = now
            self._say(self.last)
        elif self.tty and (self.drawn_at is None or now - self.drawn_at >= BAR_EVERY_S):
            self._draw(self.last)

    def finish(self, done: float | None = None, **counts: float) -> Snapshot | None:
        """The final snapshot, said when anything was said before (work that stayed quiet ends quiet too); said once,
        however often it is called."""
        if self.last is None or self.start is None or self.last.final:  # no start: no update, so no last either
            return self.last
        now = self.clock()
        final = self._snapshot(now, self.last.done if done is None else done, counts or self.last.counts, final=True)
        self.last = final
        if self.spoke_at is not None or now - self.start[0] >= self.quiet_s:
            self.spoke_at = now
            self._say(final)
        return final

    def _snapshot(self, now: float, done: float, counts: dict[str, float], final: bool) -> Snapshot:
        assert self.start is not None, "update() sets start before it takes the first snapshot"
        t0, done0, counts0 = self.start
        took = now - t0
        if final and self.total is not None:
            done = max(done, self.total)
        rate = (done - done0) / took if took > 0 else None
        rates = {k: (counts[k] - counts0.get(k, 0)) / took if took > 0 else None for k in self.rate_keys if k in counts}
        return Snapshot(self.what, done, self.total, self.unit, took, rate, dict(counts), rates, final, self.note)

    def _say(self, snap: Snapshot) -> None:
        if self.tty and not snap.final:
            self._draw(snap)
        else:
            if self.tty:  # the bar gives way to one line in the log: how long the work took
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self.log.info("%s", snap.line())
        if self.on_update is not None:
            try:
                self.on_update(snap)
            except Exception as e:  # plumbing (an artifact, a file on storage): the work goes on
                self.log.warning("progress of %s not recorded: %s: %s", self.what, type(e).__name__, e)

    def _draw(self, snap: Snapshot) -> None:
        self.drawn_at = self.clock()
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r" + snap.line(bar=True)[:width] + "\x1b[K")
        self.stream.flush()


def then(before: Reporter, after: Reporter) -> Callable[..., None]:
    """``after.update``, that first finishes ``before``: the next phase of one piece of work (staging's read, then
    its writing of shards) never speaks before the one it follows has said its last line."""

    def update(done: float, total: float | None = None, **counts: float) -> None:
        before.finish()
        after.update(done, total, **counts)

    return update


@contextlib.contextmanager
def polled(reporter: Reporter, read_done: Callable[[], float], poll_s: float = 1.0) -> Generator[Reporter, None, None]:
    """``reporter.update(read_done())`` every ``poll_s`` from a thread while the body runs (work that cannot report
    itself: a library writing a file, an upload), then ``reporter.finish()``. A failing read is skipped."""

    def poll() -> None:
        with contextlib.suppress(Exception):
            reporter.update(read_done())

    poll()
    with repeating(poll, poll_s, f"progress-{reporter.what}"):
        yield reporter
    try:
        reporter.finish(read_done())
    except Exception:
        reporter.finish()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _amount(x: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(x) >= scale:
                return f"{x / scale:.1f} {name}"
        return f"{x:.0f} B"
    return f"{_number(x)} {unit}" if unit else _number(x)


def _number(x: float) -> str:
    """``31,800``; large rates as ``1.9 M``."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:.1f} M"
    return f"{x:,.0f}" if abs(x) >= 10 or float(x).is_integer() else f"{x:.1f}"


def duration(s: float) -> str:
    s = round(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
