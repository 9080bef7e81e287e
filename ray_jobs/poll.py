"""Waiting for a condition: one deadline-and-poll loop for every caller (a head coming up, processes gone, a job
ending, room on a cluster), so the poll interval and the deadline are never re-derived by hand."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator
from typing import TypeVar

T = TypeVar("T")


def poll_until(
    predicate: Callable[[], T],
    timeout_s: float,
    every_s: float = 0.2,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T | None:
    """Call ``predicate`` until it returns something truthy (returned), at most every ``every_s`` seconds; its last
    (falsy) value once ``timeout_s`` passed. The predicate runs at least once, and once more at the deadline."""
    deadline = clock() + timeout_s
    while True:
        value = predicate()
        left = deadline - clock()
        if value or left <= 0:
            return value
        sleep(min(every_s, left))


@contextlib.contextmanager
def repeating(call: Callable[[], object], every_s: float, name: str) -> Generator[None, None, None]:
    """``call()`` every ``every_s`` seconds from a daemon thread while the body runs (the first one after
    ``every_s``); a call that returns False ends the calls. The thread is stopped and joined when the body ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            if call() is False:
                return

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
