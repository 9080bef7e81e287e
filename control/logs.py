"""Logging for task code that also runs outside a Prefect run (tests call ``task.fn``, tools call helpers)."""

from __future__ import annotations

import logging


def run_logger():
    """The Prefect run logger inside a flow/task run, else a plain ``unbroken`` logger."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("unbroken.tasks")
