"""Loading a config: YAML on disk, ``--set a.b=c`` overrides, validation into one :class:`ConfigError`, and JSON."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml
from pydantic import ValidationError

from ray_jobs.config import convert
from ray_jobs.config.base import ConfigError
from ray_jobs.config.cluster import ClusterConfig, cluster_problems
from ray_jobs.config.model import BUILTIN_PREFIX
from ray_jobs.config.reference import fields, models_in
from ray_jobs.config.run import Config
from ray_jobs.contracts.job_spec import Spec
from ray_jobs.secrets import CREDENTIALS_ENV, reveal_tree, still_masked

S = TypeVar("S", bound=Spec)  # a job spec's model (ray_jobs/contracts/job_spec.py)


@overload
def absolute_url(url: str) -> str: ...
@overload
def absolute_url(url: str | None) -> str | None: ...
def absolute_url(url: str | None) -> str | None:
    """Local relative paths become absolute (the job runs elsewhere); URLs are left alone."""
    if not url or "://" in url:
        return url
    return str(Path(os.path.expanduser(url)).resolve())


# A config as read (YAML, --set overrides), before validation: any values at all, so code that reads one narrows it
# first (``isinstance``); Config.model_validate makes it typed.
RawTree = dict[str, object]


def parse_overrides(overrides: list[str]) -> tuple[RawTree, list[str]]:
    """``["a.b=1", "c=x"]`` -> nested dict, with YAML typing of values; returns (tree, problems)."""
    tree: RawTree = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, like train.max_steps=100")
            continue
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"--set {item!r}: {part} is not a section")
                break
        else:
            node[parts[-1]] = _override_value(raw)
    return tree, problems


def _override_value(raw: str) -> Any:
    """YAML typing (``1`` is an int, ``[a, b]`` a list), except that a run name template stays a string:
    ``{date}-{dataset}`` would be YAML's flow mapping (or a syntax error)."""
    raw = raw.strip()
    if re.fullmatch(r"(?:[^{}]*\{\w*\})+[^{}]*", raw):
        return raw
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def _merge(base: RawTree, top: RawTree) -> RawTree:
    out = dict(base)
    for k, v in top.items():
        below = out.get(k)
        out[k] = _merge(below, v) if isinstance(v, dict) and isinstance(below, dict) else v
    return out


def _read_yaml(path: str | os.PathLike) -> RawTree:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"cannot read config file: {e}"], str(path)) from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError([f"{where}: not valid YAML: {getattr(e, 'problem', e)}"], str(path)) from e
    if not isinstance(data, dict):
        raise ConfigError(["top level must be a mapping of sections"], str(path))
    return data


def _field_name(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def validate(raw: RawTree, source: str = "config") -> Config:
    """Validate a raw tree; every problem is collected into one ConfigError (the cluster backend's checks too,
    which read its files: a ``ray up`` YAML)."""
    problems: list[str] = []
    cfg = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            msg = unknown_key(err["loc"]) if err["type"] == "extra_forbidden" else err["msg"]
            msg = msg.removeprefix("Value error, ")
            named = not err["loc"] and re.match(r"[a-z_]+(\.[a-z_]+)*: ", msg)  # a cross-field check names its field
            problems += msg.split("\n  - ") if named else [f"{_field_name(err['loc'])}: {msg}"]
    cluster = cfg.cluster if cfg is not None else cluster_alone(raw)
    if cluster is not None:
        problems += cluster_problems(cluster, str(raw.get("storage") or ""))
    if problems and (flavour := convert.flavour_of(raw)) and not {"data", "model", "train"} & raw.keys():
        file = source if source != "config" else "FILE"
        tool = convert.TOOL[flavour]
        problems.insert(0, f"{tool}'s keys: `unbroken convert {file}` writes unbroken's config from {tool}'s")
    if problems:
        raise ConfigError(problems, source)
    assert cfg is not None, "a config that did not validate has its problems raised just above"
    cfg.storage = absolute_url(cfg.storage)
    cfg.data.resolve_paths(absolute_url)
    cfg.cluster.ray_up.config = absolute_url(cfg.cluster.ray_up.config) or ""
    if not cfg.model.name_or_path.startswith(BUILTIN_PREFIX) and Path(cfg.model.name_or_path).exists():
        cfg.model.name_or_path = absolute_url(cfg.model.name_or_path)
    return cfg


def unknown_key(loc: tuple[Any, ...]) -> str:
    """``unknown key``, and what was meant: unbroken's field for another tool's key (Axolotl's, TRL's: the tables of
    ray_jobs/config/convert.py), else the field of that section nearest in spelling or sharing its words, else a field
    of that name in another section."""
    key, parent = str(loc[-1]), loc[:-1]
    here = f"{_field_name(parent)}." if parent else ""
    hint = _other_tools(key, here) or _nearest(key, _fields_at(parent), here)
    if not hint:
        hint = next((f"did you mean {f.name}?" for f in fields(Config) if f.name.rpartition(".")[2] == key), "")
    return f"unknown key ({hint})" if hint else "unknown key"


def _other_tools(key: str, here: str) -> str:
    hints = []
    for dotted, rows in convert.other_names(key).items():
        whose = " and ".join(f"{convert.TOOL[flavour]}'s" for flavour, _ in rows)
        if dotted is None:
            hints.append(f"{whose} key; {rows[0][1].note}")
        elif dotted.rpartition(".")[0] == here.removesuffix("."):  # a field of the section it was written in
            hints.append(f"did you mean {dotted}? {key} is {whose} name")
        else:
            hints.append(f"{whose} name; unbroken's is {dotted}")
    return "; ".join(hints)


def _nearest(key: str, names: list[str], here: str) -> str:
    """The name nearest in spelling (``max_step``: max_steps), else the one sharing the most of its words
    (``lr_rate``: lr; ``batch_size``: micro_batch_size)."""
    near = difflib.get_close_matches(key, names, n=1)
    words = set(key.split("_"))
    shared = [n for n in names if words <= set(n.split("_")) or set(n.split("_")) <= words]
    if not near and shared:
        near = [max(shared, key=lambda n: (len(words & set(n.split("_"))), -len(n)))]
    return f"did you mean {here}{near[0]}?" if near else ""


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section at ``loc`` (a validation error's path under Config): a list's index or a
    union member's tag in the path stays at the section it is in."""
    models = [Config]
    for part in loc:
        if any(part in m.model_fields for m in models):
            models = [s for m in models if part in m.model_fields for s in models_in(m.model_fields[part].annotation)]
    return sorted({name for m in models for name in m.model_fields})


def cluster_alone(raw: RawTree) -> ClusterConfig | None:
    """The cluster section on its own, when the whole config did not validate (its own errors are reported)."""
    try:
        return ClusterConfig.model_validate(raw.get("cluster") or {})
    except ValidationError:
        return None


def raw_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RawTree:
    """The YAML (optional) with ``--set`` overrides applied, not yet validated; ConfigError for a bad override. Masked
    URIs are revealed with this process's ``UNBROKEN_CREDENTIALS`` (the CLI masks the overrides it makes a flow run's
    parameters and keeps their credentials there: ray_jobs/secrets.py)."""
    raw = _read_yaml(path) if path is not None else {}
    tree, problems = parse_overrides(overrides or [])
    if problems:
        raise ConfigError(problems, str(path or "overrides"))
    return reveal_tree(_merge(raw, tree))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (optional), apply ``--set`` overrides, validate; raises ConfigError naming every bad field."""
    return validate(raw_config(path, overrides), str(path or "config"))


def from_json(text: str) -> Config:
    """The inverse of ``Config.model_dump_json()``: how the Ray job receives its config, and the watchdog a run
    record's. What was written is masked (ray_jobs/secrets.py): its URIs are revealed with this process's
    ``UNBROKEN_CREDENTIALS`` (a job's runtime_env, the watchdog's environment); those it was not given stay masked."""
    return Config.model_validate_json(json.dumps(reveal_tree(json.loads(text))))


def job_spec(prog: str, kind: type[S], argv: list[str] | None = None) -> tuple[S, Config]:
    """What a Ray Jobs entrypoint (``python -m <prog> --spec <url>``) was given: the spec, read as ``kind``
    (``ray_jobs/contracts/job_spec.py``; its credentials revealed), and its config parsed (:func:`from_json`). A
    credential it was not given is said once, in the job's log, naming its field."""
    import argparse
    import logging

    from ray_jobs.storage import read_json

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--spec", required=True, help="URL of the job spec JSON the flow wrote to storage")
    url = parser.parse_args(argv).spec
    spec = kind.parse(reveal_tree(read_json(url)), url)
    cfg = from_json(json.dumps(spec.config))
    if missing := still_masked(json.loads(cfg.model_dump_json())):
        logging.getLogger(prog).warning(
            "the credentials of %s did not reach this job (%s is not set: a restart by a watchdog that had neither "
            "them nor the previous job to take them from); what needs them runs without",
            ", ".join(missing),
            CREDENTIALS_ENV,
        )
    return spec, cfg
