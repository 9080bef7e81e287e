"""Logging for the control plane, which never imports Prefect: a plain ``unbroken`` logger, unless the layer that
runs it inside Prefect (``tasks``, on import) installed the run logger, so that what the watchdog or a backend says
lands in the flow run's log in the UI."""

from __future__ import annotations

import logging
from collections.abc import Callable

# A log record's attribute: a line of a job's own log, relayed into the flow run's (the CLI's console hides it).
RELAYED = "unbroken_relayed"

_run_logger: Callable[[], logging.Logger | logging.LoggerAdapter] | None = None


def use(factory: Callable[[], logging.Logger | logging.LoggerAdapter]) -> None:
    """Log through ``factory()`` from now on (it falls back to a plain logger itself outside a run)."""
    global _run_logger
    _run_logger = factory


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The installed run logger (Prefect's, inside a flow or task run), else a plain ``unbroken`` logger."""
    return _run_logger() if _run_logger is not None else logging.getLogger("unbroken.control")
