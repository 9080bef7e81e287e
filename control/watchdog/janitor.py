"""Clusters left behind: what a flow or watchdog killed before its ``down`` left running."""

from __future__ import annotations

from control.backends import janitor_backends
from control.backends.janitor import sweep


def janitor(storage: str) -> list[str]:
    """Remove what unbroken made for runs under ``storage`` that are over (finished, failed, or their record gone)
    and did not ask to keep it -- what a flow or watchdog killed before its ``down`` left running: one pass of each
    backend that leaves such things behind (control/backends/janitor.py). Returns what was removed."""
    return [what for backend in janitor_backends() for what in sweep(backend, storage)]
