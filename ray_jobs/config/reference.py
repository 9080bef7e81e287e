"""The config reference, generated from the typed config itself: every field's dotted name, type, default and
description (its attribute docstring), section by section. The documentation site's "Config reference" page is this
(docs/hooks.py builds it on every ``mkdocs build``), so no field can go undocumented or drift from what the code
accepts: tests/unit/test_docs.py fails on a field without a description."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ray_jobs.config.convert import TOOL, Flavour, names_by_field

OTHERS = "Axolotl / TRL name"


@dataclass(frozen=True)
class FieldDoc:
    name: str  # dotted: train.max_steps
    type: str
    default: str  # "required" when there is none
    description: str


def sections(model: type[BaseModel]) -> list[tuple[type[BaseModel], str]]:
    """(the model, its dotted prefix) of ``model`` and every section under it, depth first."""
    out = [(model, "")]
    for name, info in model.model_fields.items():
        for sub in models_in(info.annotation):
            out += [(m, f"{name}.{p}" if p else f"{name}.") for m, p in sections(sub)]
    return out


def fields(model: type[BaseModel]) -> list[FieldDoc]:
    """Every field of ``model`` and the sections under it; a section field is listed too, with its description."""
    docs = []
    for section, prefix in sections(model):
        for name, info in section.model_fields.items():
            docs.append(FieldDoc(prefix + name, _type(info.annotation), _default(info), _one_line(info.description)))
    return docs


def markdown(model: type[BaseModel], title: str = "Config reference") -> str:
    by_section: dict[str, list[FieldDoc]] = {}
    for f in fields(model):
        by_section.setdefault(f.name.rpartition(".")[0] or "(top level)", []).append(f)
    out = [
        f"# {title}",
        "",
        "Generated from the typed config (`ray_jobs/config/`, `ray_jobs/config/reference.py`) on "
        "every build: each field, its type, default and description. A YAML file sets any of them; `--set "
        "section.field=value` overrides one. The Axolotl / TRL column names the keys of theirs that set a field: "
        "`unbroken convert FILE` writes such a config as unbroken's.",
        "",
    ]
    others = names_by_field()
    for section, docs in by_section.items():
        out += [f"## `{section}`", "", f"| field | type | default | {OTHERS} | description |", "|---|---|---|---|---|"]
        out += [
            f"| `{d.name}` | {_cell(d.type)} | {_cell(d.default)} | {_others(others.get(d.name, []))} | "
            f"{_cell(d.description)} |"
            for d in docs
        ]
        out.append("")
    return "\n".join(out)


def _others(names: list[tuple[Flavour, str]]) -> str:
    """Another tool's keys for a field (ray_jobs/config/convert.py's tables): ``learning_rate`` (both tools'),
    ``num_epochs`` (Axolotl)."""
    tools: dict[str, list[str]] = {}
    for flavour, key in names:
        tools.setdefault(key, []).append(TOOL[flavour])
    return ", ".join(f"`{k}`" + ("" if len(t) == len(TOOL) else f" ({', '.join(t)})") for k, t in tools.items())


def models_in(annotation: object) -> list[type[BaseModel]]:
    """The config sections a field's type holds: itself, or those of a union or a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def _type(annotation: object) -> str:
    if annotation is type(None):
        return "none"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return "section" if issubclass(annotation, BaseModel) else annotation.__name__
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)  # the factory's value, or (a copy of) the default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return "none" if value is None else repr(value)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if "\\|" not in text else text
