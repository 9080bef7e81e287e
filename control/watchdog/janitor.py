"""Clusters left behind: what unbroken made for runs that ended without their backend's ``down`` (a flow or a
watchdog killed before it) is removed once their run is over. Each backend that can leave something behind says where
its markers are (``janitor_index``: the runs that used it, marked when their attempt was recorded), where it looks
(``janitor_scope``) and what it removes there (``janitor``); the watchdog makes one pass over each such backend's
runs every pass. (It reads the run registry, which reads the backends: it lives above both.)"""

from __future__ import annotations

from control import registry
from control.backends import backend_for, janitor_backends
from control.backends.base import Backend
from control.logs import run_logger


def janitor(storage: str) -> list[str]:
    """Remove what unbroken made for runs under ``storage`` that are over (finished, failed, or their record gone)
    and did not ask to keep it -- what a flow or watchdog killed before its ``down`` left running: one pass of each
    backend that leaves such things behind. Returns what was removed."""
    return [what for backend in janitor_backends() for what in sweep(backend, storage)]


def is_over(storage: str, run: str) -> bool:
    """A run whose leftovers may go: finished or failed (or its record gone), and not asking to keep its cluster."""
    reg = registry.load(storage, run)
    return reg is None or (not reg.active and not registry.pick(reg.config, "cluster.keep_running"))


def sweep(backend: type[Backend], storage: str) -> list[str]:
    """Look once in every place a run marked for ``backend`` under ``storage`` used, removing what belongs to runs
    that are over; a finished run is unmarked once every place was looked at without an error (not read again on
    later passes). Returns what was removed."""
    index = backend.janitor_index(storage)
    if index is None:  # a backend that leaves nothing behind keeps no markers: nothing to sweep
        return []
    seen: set[object] = set()  # the janitor_scope() of each place looked at this pass
    removed: list[str] = []
    done: list[str] = []
    for run in registry.marked_runs(index):
        reg = registry.load(storage, run)
        if reg is None:  # where it ran is unknown now; any other run's look there still finds what it left
            registry.unmark(index, run)
            continue
        if not reg.active:  # finished: what it left goes now, or is kept for good
            done.append(run)
        found = backend_for(reg.cfg())
        if found.janitor_scope() in seen:
            continue
        seen.add(found.janitor_scope())
        for what in found.janitor(is_over):
            run_logger().warning(
                "janitor: %s removed %s in %s (its run is over)", backend.name, what, found.janitor_scope()
            )
            removed.append(what)
    for run in done:
        registry.unmark(index, run)
    return removed
