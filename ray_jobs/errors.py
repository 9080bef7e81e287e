"""The one mark of a user's mistake. An exception class that derives from :class:`UserError` says: what went wrong
is the input's (a config field, a data file's line, a model, a cluster address, a storage URL), its message names it
and what to do, and nothing in unbroken is broken. The command line prints such an error as its message alone and
exits 2, without a traceback (``--debug`` shows it); any other exception is a failure or a bug and keeps its
traceback. Lowest layer (no imports), so every layer can mark its errors.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave; its message is the whole story (it names the field, file:line or URL)."""


def user_error(exc: BaseException | None) -> UserError | None:
    """The user's mistake ``exc`` is, or was raised from (its ``__cause__``/``__context__`` chain: a library that
    wraps it), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
