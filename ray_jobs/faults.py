"""Test-only fault injection: make a phase (or every step) of a real job take longer.

``UNBROKEN_INJECT_DELAY="exporting:25,evaluating:12,step:0.1"``: on first entering ``exporting`` the job sleeps
25 s inside that phase (its heartbeat keeps beating), the first eval pass 12 s longer, and every training step
0.1 s longer. It exists so tests can make an export or eval longer than the training stall limit, or land a
20-second fault mid-training, without a multi-GB model. A sleep changes no number: weights stay bit-identical.
``checkpoint_file:30`` sleeps 30 s after each file of a checkpoint lands (a kill then tears the write for real).
``UNBROKEN_INJECT_DELAY_FILE=<path>``: the same spec read from that file, read again whenever it changes (a served
test slows down one run of a long-lived server, not every one; a chaos test slows a run down until the faults it
waits for have happened, then lets it finish at full speed). Unset (always, outside tests): a no-op.
"""

from __future__ import annotations

import functools
import os
import time

ENV = "UNBROKEN_INJECT_DELAY"
FILE_ENV = "UNBROKEN_INJECT_DELAY_FILE"
_done: set[str] = set()


def _from_file(path: str) -> str:
    """The file's spec; a step asks it each time, so it is read again only when the file changed (one ``stat``)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return _read(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime_ns: int, size: int) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def delays(spec: str | None = None) -> dict[str, float]:
    """``phase -> seconds`` from the variable and the file (or ``spec``); a malformed entry is an error, not a silent
    no-op."""
    if spec is None:
        spec = ",".join(filter(None, [os.environ.get(ENV, ""), _from_file(os.environ.get(FILE_ENV, ""))]))
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        phase, sep, seconds = item.partition(":")
        if not sep:
            raise ValueError(f"{ENV}: expected phase:seconds, got {item!r}")
        out[phase.strip()] = float(seconds)
    return out


def on_phase(phase: str) -> None:
    """Sleep the injected delay the first time this process enters ``phase``."""
    seconds = delays().get(phase)
    if seconds and phase not in _done:
        _done.add(phase)
        time.sleep(seconds)


def on_step() -> None:
    """Sleep the injected per-step delay."""
    seconds = delays().get("step")
    if seconds:
        time.sleep(seconds)


def on_checkpoint_file() -> None:
    """Sleep the injected delay after each file of a checkpoint's part lands (``checkpoint_file:<seconds>``): a test
    kills the process while the part is half on storage and its manifest is not, a torn write of the real writer."""
    seconds = delays().get("checkpoint_file")
    if seconds:
        time.sleep(seconds)
