"""Which datasets a dataset event may point a run at: the served config's ``data.allowed_sources``.

A served finetune deployment trains on whatever ``dataset_uri`` an ``unbroken.dataset.updated`` event carries.
Without a check, anyone who can emit an event could have the flow's machine read any file it can (``/etc/passwd``
into ``rejects.jsonl``) or any URL it can reach (an internal http endpoint). So the URI must fall under one of the
served config's prefixes, compared after normalising: local paths resolved (``..`` and symlinks), other protocols
compared as protocol + posix path with no ``..`` at all, and a prefix matching only at a path boundary. The flow
checks the URI as the event sent it, then ``data.train`` as the loaded config holds it (``flows/params.run_config``):
what is judged is what staging will read. The URI replaces ``data.train`` whole, a list of sources too: the run
trains on that one source.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from ray_jobs.config import Config
from ray_jobs.errors import UserError
from ray_jobs.secrets import MaskedError, mask_tree

LOCAL = ("", "file", "local")


class SourceRefused(MaskedError, UserError, ValueError):
    """A dataset URI outside ``data.allowed_sources`` (named masked: the message is a flow run's state)."""


def _split(uri: str) -> tuple[str, str]:
    """(protocol, path) with local paths and file:// URLs resolved to real absolute paths."""
    protocol, sep, rest = uri.partition("://")
    if not sep:
        protocol, rest = "", uri
    if protocol in LOCAL:
        return "file", os.path.realpath(os.path.expanduser(rest or "/"))
    if any(part == ".." for part in rest.split("/")):
        raise SourceRefused(f"dataset URI {uri!r}: '..' is not allowed in a {protocol}:// path (data.allowed_sources)")
    return protocol, posixpath.normpath("/" + rest.lstrip("/"))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/") or prefix == "/"


def allowed_prefixes(cfg: Config) -> list[str]:
    """The config's ``data.allowed_sources``, or when empty the folder holding ``data.train`` (each ``path`` of a
    list of sources; a hub dataset names no folder)."""
    if cfg.data.allowed_sources:
        return list(cfg.data.allowed_sources)
    train = cfg.data.train
    return [_folder(train)] if isinstance(train, str) else [_folder(e.path) for e in train if e.path is not None]


def _folder(train: str) -> str:
    protocol, path = _split(train)
    if protocol == "file":
        return path if Path(path).is_dir() else os.path.dirname(path)
    rest = train.partition("://")[2]
    return f"{protocol}://{rest.rstrip('/') if rest.endswith('/') else posixpath.dirname(rest)}"  # a folder: itself


def check_allowed_source(cfg: Config, dataset_uri: str) -> str:
    """The URI if it falls under an allowed prefix; SourceRefused naming the field otherwise."""
    prefixes = allowed_prefixes(cfg)
    protocol, path = _split(dataset_uri.strip())
    for prefix in prefixes:
        p_protocol, p_path = _split(prefix)
        if p_protocol == protocol and _under(path, p_path):
            return dataset_uri.strip()
    raise SourceRefused(
        f"dataset URI {dataset_uri!r} is not under data.allowed_sources ({', '.join(prefixes) or 'none'}); a dataset event "
        "may only name data under these prefixes -- add the location to data.allowed_sources in the served config"
    )


def rejected_event(cfg: Config, dataset_uri: str | None, reason: str) -> None:
    """``unbroken.dataset.rejected`` for people and automations watching the event feed."""
    from prefect.events import emit_event

    emit_event(
        event="unbroken.dataset.rejected",
        resource={"prefect.resource.id": f"unbroken.run.{cfg.name}", "prefect.resource.name": cfg.name},
        payload=mask_tree({"dataset_uri": dataset_uri, "reason": reason, "allowed": allowed_prefixes(cfg)}),
    )
