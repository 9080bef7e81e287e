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
        for sub in _models(info.annotation):
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
        "section.field=value` overrides one.",
        "",
    ]
    for section, docs in by_section.items():
        out += [f"## `{section}`", "", "| field | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{d.name}` | {_cell(d.type)} | {_cell(d.default)} | {_cell(d.description)} |" for d in docs]
        out.append("")
    return "\n".join(out)


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


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
