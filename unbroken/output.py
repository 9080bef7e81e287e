"""What a command shows on the terminal: unbroken's own lines (its progress, its warnings, one block per problem),
and of the libraries it drives (Prefect, its temporary server, transformers, datasets) only what warns or fails.
``-v`` shows everything, as before. Nothing is lost: a flow run's records all reach Prefect's API (the UI, the flow
run's logs); only the console handler filters.

Which lines are unbroken's is told by where they were logged from -- a module of one of its packages -- not by the
logger's name: its flows and tasks log through Prefect's run loggers, as Prefect's own engine does."""

from __future__ import annotations

import importlib.util
import logging
import os

from control.logs import RELAYED

PACKAGES = ("unbroken", "deployments", "flows", "tasks", "control", "ray_jobs")

# Set before the libraries are imported (each reads its own once): progress bars for work that takes a blink (a tiny
# model's "Writing model shards", a hub file's download), the libraries' INFO chatter on their own handlers.
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def folders() -> tuple[str, ...]:
    """The folders of unbroken's packages (found without importing them: ``flows`` would import Prefect)."""
    out = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:  # an editable install adds its path hook: not a folder
            out += [os.path.join(p, "") for p in spec.submodule_search_locations or [] if os.path.isdir(p)]
    return tuple(dict.fromkeys(out))


class OwnLines(logging.Filter):
    """Passes what warns or fails, and what unbroken's own code logged; drops the libraries' INFO and DEBUG, and the
    lines of a Ray job's log that the watch relays (the flow run's log keeps them: the Prefect UI)."""

    def __init__(self, own: tuple[str, ...]) -> None:
        super().__init__()
        self.own = own

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return record.pathname.startswith(self.own) and not getattr(record, RELAYED, False)


def quiet_env() -> None:
    """The libraries' own switches, unless the user set them (before they are imported)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def quiet_console() -> None:
    """Filter Prefect's console handler (set up on Prefect's import) to unbroken's own lines and every warning."""
    import prefect.main  # noqa: F401 -- sets Prefect's logging up, console handler included
    from prefect.logging.handlers import PrefectConsoleHandler

    own = folders()
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, OwnLines) for f in handler.filters):
                handler.addFilter(OwnLines(own))
