"""How a command ends on an exception. A user's mistake (a :class:`~ray_jobs.errors.UserError`, however deep it was
raised: a config field, a data file's line, a model, a cluster address, a storage URL) is its message alone and exit
2; any other exception is a failure: its message and exit 1, with the traceback when it is not one of unbroken's own
failures (a bug shows where it is). ``--debug`` (or ``UNBROKEN_DEBUG=1``) shows every traceback.

A flow that fails on a user's mistake has Prefect log it twice with a traceback (the task run, then the flow run)
and twice more as "Finished in state Failed(...)": :func:`hide_user_errors` keeps those records off the terminal
(the flow run's state and the Prefect UI still have them), so the message is printed once, by the command.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import traceback

from ray_jobs.errors import user_error
from ray_jobs.secrets import MaskedError, mask

DEBUG_ENV = "UNBROKEN_DEBUG"
USER_ERROR, FAILED, INTERRUPTED = 2, 1, 130


def debugging(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def report(exc: BaseException, debug: bool) -> int:
    """Print ``exc`` as the command's last word on stderr and return the exit status."""
    if isinstance(exc, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    mistake = user_error(exc)
    if debug or (mistake is None and not isinstance(exc, MaskedError)):
        print(mask("".join(traceback.format_exception(exc))), file=sys.stderr, end="")
    if mistake is not None:
        print(f"error: {mask(str(mistake))}", file=sys.stderr)
        for note in getattr(mistake, "__notes__", []):  # what the command knows of it (unbroken/output.py)
            print(f"  {mask(note)}", file=sys.stderr)
        return USER_ERROR
    print(f"error: {type(exc).__name__}: {mask(str(exc))}", file=sys.stderr)
    return FAILED


class _UserErrorRecords(logging.Filter):
    """Drops Prefect's records about a user's mistake: the one carrying it (with its traceback), then any later error
    record or "Finished in state Failed(...)" line (a flow's is INFO) quoting its message: those carry no exception."""

    def __init__(self) -> None:
        super().__init__()
        self.quotes: collections.deque[str] = collections.deque(maxlen=64)  # a long-lived watchdog's stay bounded

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("prefect"):
            return True
        mistake = user_error(record.exc_info[1]) if record.exc_info else None
        if mistake is not None:
            self.quotes.append(quote(mistake))
            return False
        text = record.getMessage()
        if record.levelno < logging.ERROR and not text.startswith("Finished in state"):  # a flow's is INFO
            return True
        return not any(q and q in text for q in self.quotes)


def quote(exc: BaseException) -> str:
    """A piece of the message that a ``repr`` of the exception (or of a state holding it) quotes verbatim: its first
    line up to the first character ``repr`` might escape."""
    first = str(exc).split("\n", 1)[0]
    for i, c in enumerate(first):
        if c in "'\"\\" or not c.isprintable():
            first = first[:i]
            break
    return first[:120] if len(first) >= 12 else ""  # too short to tell one message from another


def hide_user_errors() -> None:
    """Keep Prefect's records of a user's mistake off the terminal (its console handler; the API's still gets them)."""
    import prefect.main  # noqa: F401 -- sets Prefect's logging up, console handler included
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _UserErrorRecords) for f in handler.filters
        ):
            handler.addFilter(_UserErrorRecords())
