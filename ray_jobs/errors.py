"""The one mark of a user's mistake. An exception class that derives from :class:`UserError` says: what went wrong
is the input's (a config field, a data file's line, a model, a cluster address, a storage URL), its message names it
and what to do, and nothing in unbroken is broken. The command line prints such an error as its message alone and
exits 2, without a traceback (``--debug`` shows it); any other exception is a failure or a bug and keeps its
traceback. Lowest layer (it imports nothing of the project), so every layer can mark its errors.
"""

from __future__ import annotations

from typing import ClassVar


class UserError(Exception):
    """A mistake in what the user gave; its message is the whole story (it names the field, file:line or URL)."""

    users_fault: ClassVar[bool] = True  # False: a subclass that may be the environment's fault (a source not served)


class RunNotFound(UserError, FileNotFoundError):
    """A run name, or a storage root, with no run record there: a command that looks a run up names both."""


def user_error(exc: BaseException | None) -> UserError | None:
    """The user's mistake ``exc`` is, or was raised from (``raise ... from``: its ``__cause__`` chain, a library
    that wraps it), or None. Not an exception raised *while handling* one (``__context__``): that one is its own."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError) and exc.users_fault:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None
