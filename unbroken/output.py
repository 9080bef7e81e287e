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

VERBOSE_ENV = "UNBROKEN_VERBOSE"  # =1: as -v (the test suite's runs read the job logs they relay)
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


def verbose(flag: bool = False) -> bool:
    return flag or os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


# Loggers whose warnings at import say nothing a run can act on: bitsandbytes' CPU backend warns, on every import of
# peft (so of TRL, whose arguments classes a config's hf_args are checked against), that an optional fused 4-bit
# kernel from the `kernels` package is missing -- a speed-up for 4-bit on CPU, not a fault.
IMPORT_CHATTER = ("bitsandbytes.backends.cpu.ops",)


def quiet_env() -> None:
    """The libraries' own switches, unless the user set them (before they are imported)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in IMPORT_CHATTER:
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_console() -> None:
    """Filter Prefect's console handler (set up on Prefect's import) to unbroken's own lines and every warning."""
    import prefect.main  # noqa: F401 -- sets Prefect's logging up, console handler included
    from prefect.logging.handlers import PrefectConsoleHandler

    own = folders()
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, OwnLines) for f in handler.filters):
                handler.addFilter(OwnLines(own))


def relative_paths(raw: dict) -> list[tuple[str, str]]:
    """The config's relative local paths as (field, path written): each is read from the current folder, not the
    config file's (a job runs elsewhere: every path is made absolute when the config loads)."""
    data = raw.get("data")
    data = data if isinstance(data, dict) else {}
    train = data.get("train")
    listed = isinstance(train, list)
    named = [("storage", raw.get("storage")), ("data.eval", data.get("eval"))]
    for i, e in enumerate(train if listed else [train]):
        field = f"data.train[{i}]" if listed else "data.train"
        named += [(f"{field}.path", e.get("path"))] if isinstance(e, dict) else [(field, e)]
    return [(field, value) for field, value in named if isinstance(value, str) and _relative(value)]


def note_missing(error: BaseException, relative: list[tuple[str, str]]) -> None:
    """A note on ``error`` when it says a path does not exist that the config gave relative: where it was looked
    for (errors.report prints a user error's notes after its message)."""
    from ray_jobs.errors import user_error

    error = user_error(error) or error  # the mistake errors.report prints, however deep it was raised
    text = str(error)
    if "no such file" not in text:
        return
    for field, value in relative:
        if os.path.abspath(os.path.expanduser(value)) in text:
            error.add_note(f"{field} {value} is relative: read from the current folder {os.getcwd()}, not the config's")


def _relative(value: str) -> bool:
    return bool(value) and "://" not in value and not value.startswith(("/", "~"))
