"""The janitor: what unbroken made for runs that ended without their backend's ``down`` (a flow or a watchdog killed
before it) is removed once their run is over. Each backend that can leave something behind says where its markers
are (``janitor_index``: the runs that used it, marked when their attempt was recorded), where it looks
(``janitor_scope``) and what it removes there (``janitor``); this is one pass over one such backend's runs, which
the watchdog makes every pass."""

from __future__ import annotations

from control import registry
from control.backends import backend_for
from control.backends.base import Backend
from control.logs import run_logger


def is_over(storage: str, run: str) -> bool:
    """A run whose leftovers may go: finished or failed (or its record gone), and not asking to keep its cluster."""
    reg = registry.load(storage, run)
    return reg is None or (not reg.active and not registry._pick(reg.config, "cluster.keep_running"))


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
