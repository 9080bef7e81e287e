"""Prefect tasks: small typed verbs, one side effect each (stage, provision, submit, watch, ...).

Importing this package routes the control plane's logging into Prefect's run logs (control/logs.py), and masks every
log record of the process (ray_jobs/secrets.py): what a flow run logs is stored and shown by Prefect, and the job's
log is forwarded into it."""

from __future__ import annotations

import logging

from control import logs
from ray_jobs.secrets import mask_logs


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow/task run, else a plain ``unbroken`` logger (tests call ``task.fn``,
    tools call helpers outside any run)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("unbroken.tasks")


logs.use(run_logger)
mask_logs()
