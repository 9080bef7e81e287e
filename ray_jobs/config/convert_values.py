"""How another tool's value becomes an unbroken field's: the ``how`` column of convert.py's tables. Each transform
takes the value and the :class:`Context` (the whole file, its folder) and returns the field's value, a
:class:`Fields` (several fields, or a note), None (nothing to set: off, or unbroken's default) or raises
:class:`Cannot` (the value is not honoured, and why). Most of it is data's: Axolotl's ``datasets`` / ``test_datasets``
entries (a path, a ``type``, a prompt's field names) and TRL's ``dataset_name``. Pure: no torch, Prefect or Ray."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Cannot(Exception):
    """A known key whose value unbroken cannot honour; the message says why (``not needed: ...``, ``not supported:
    ...``)."""


@dataclass(frozen=True)
class Context:
    source: dict[str, Any]  # the whole file, as read: a key's transform may look at another (lora_r at adapter)
    folder: Path  # the file's folder: a relative dataset path is resolved from there


@dataclass(frozen=True)
class Fields:
    """A transform's answer when its key sets several fields (``datasets``: data.train and data.format), or one
    field with a note on how it was mapped."""

    values: dict[str, Any]
    note: str = ""


# Axolotl's dataset types -> data.format; a type ``name:variant`` (sharegpt:chatml) is its name's.
TYPES = {"alpaca": "alpaca", "sharegpt": "sharegpt", "chat_template": "chat", "completion": "text"}
TYPE_NOTES = {
    "alpaca": "alpaca: as a chat with the tokenizer's template when it has one, else Alpaca's prompt (Axolotl's always)",
    "sharegpt": "sharegpt: rendered with the tokenizer's own chat template, the assistant's turns learned",
    "chat_template": "chat_template: rendered with the tokenizer's own chat template, the assistant's turns learned",
    "completion": "completion: text documents, all of them learned (a long one cut into data.seq_len pieces)",
}
INPUT_OUTPUT = (
    "not supported: input_output's segments each say whether they are learned; unbroken learns a pair's target or a "
    "chat's assistant turns: write the records as {input, target} (data.format: pairs)"
)
LOADERS = ("json", "parquet", "arrow", "csv", "text")  # datasets' builders: the files are the entry's data_files
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
LOCAL = "a local path, written absolute (unbroken resolves a relative path from where it runs, not from its config)"


@dataclass(frozen=True)
class Source:
    where: str | dict[str, Any]  # a path or URL, or a hub dataset's mapping ({hub: owner/name, split: ...})
    format: str
    fields: dict[str, Any] = field(default_factory=dict)  # the data.* fields its format reads (data.text_field)
    notes: tuple[str, ...] = ()


def where(path: str, ctx: Context, **hub: Any) -> tuple[str | dict[str, Any], str]:
    """A source as data.train takes it, and a note: a URL as is; a local path resolved from the config's folder (or,
    failing that, from where the command runs, as Axolotl resolves it) and written absolute; a hub id as a hub
    dataset's mapping, with what ``hub`` says of it that is not the default (split, subset, revision)."""
    if "://" in path:
        return path, ""
    p = Path(path).expanduser()
    for base in (ctx.folder, Path.cwd()):
        if (base / p).exists():
            return str((base / p).resolve()), LOCAL
    if HUB_ID.fullmatch(path) and not p.suffix:
        options = {k: v for k, v in hub.items() if v is not None and (k, v) != ("split", "train")}
        return {"hub": path, **options}, (
            f"{path}: a Hugging Face hub dataset, read through the datasets library and its cache (offline: from the "
            "cache alone)"
        )
    return str((ctx.folder / p).resolve()), f"{path}: not found; {LOCAL}, from the config's folder"


def datasets(value: Any, ctx: Context) -> Fields:
    """Axolotl's ``datasets``: one entry is data.train and data.format; several are a mixture, a list of
    ``{path or hub, weight, format}``."""
    entries = value if isinstance(value, list) else [value]
    sources = [_entry(e, f"datasets[{i}]", ctx) for i, e in enumerate(entries)]
    fields: dict[str, Any] = {}
    notes = [n for s in sources for n in s.notes]
    for s in sources:
        for k, v in s.fields.items():
            if fields.setdefault(k, v) != v:
                notes.append(f"{k}: the sources name different fields ({fields[k]!r}, {v!r}); the first kept")
    if len(sources) == 1:
        return Fields({"data.train": sources[0].where, "data.format": sources[0].format, **fields}, _lines(notes))
    mixture = [{**_mapping(s.where), "weight": 1, "format": s.format} for s in sources]
    notes.insert(0, f"a mixture of {len(sources)} sources, each written with weight 1 (Axolotl concatenates them)")
    return Fields({"data.train": mixture, **fields}, _lines(notes))


def _mapping(source: str | dict[str, Any]) -> dict[str, Any]:
    return {"path": source} if isinstance(source, str) else source


def test_datasets(value: Any, ctx: Context) -> Fields:
    """Axolotl's ``test_datasets``: one file or folder, data.eval (staged in the training data's format)."""
    entries = value if isinstance(value, list) else [value]
    if len(entries) > 1:
        raise Cannot("not supported: data.eval is one source; merge the test sets into one file or folder")
    s = _entry(entries[0], "test_datasets[0]", ctx)
    if not isinstance(s.where, str):
        raise Cannot("not supported: data.eval is a file, folder or URL, not a hub dataset; save the split to a file")
    return Fields({"data.eval": s.where}, _lines([*s.notes, "staged in data.format, as the training data is"]))


def _lines(notes: list[str]) -> str:
    return "\n".join(dict.fromkeys(n for n in notes if n))


def _entry(entry: Any, name: str, ctx: Context) -> Source:
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict) or not entry.get("path"):
        raise Cannot(f"not supported: {name} has no path")
    fmt, fields, notes = _format(entry.get("type"), entry, name)
    hub = {"split": entry.get("split"), "subset": entry.get("name"), "revision": entry.get("revision")}
    source, note = where(_file(entry, name), ctx, **hub)
    if isinstance(source, str):
        notes += [f"{name}.{k}: {v!r} not read (a hub dataset's)" for k, v in hub.items() if v not in (None, "train")]
    return Source(source, fmt, fields, (note, *notes))


def _file(entry: dict[str, Any], name: str) -> str:
    path, files = str(entry["path"]), entry.get("data_files")
    files = [files] if isinstance(files, str) else list(files or [])
    if len(files) > 1:
        raise Cannot(f"not supported: {name} has several data_files; put them in one folder and name the folder")
    if path in LOADERS and not files:
        raise Cannot(f"not supported: {name}: path {path!r} without data_files")
    if not files:
        return path
    return str(files[0]) if path in LOADERS else str(Path(path) / str(files[0]))


def _format(kind: Any, entry: dict[str, Any], name: str) -> tuple[str, dict[str, Any], list[str]]:
    """data.format, the fields it reads, and notes, for an entry's ``type``."""
    if kind is None:
        return "auto", {}, [f"{name} has no type: data.format auto (detected from its first records)"]
    if isinstance(kind, dict):
        return _custom(kind, name)
    base = str(kind).split(":")[0]
    if base == "input_output":
        raise Cannot(INPUT_OUTPUT)
    if base not in TYPES:
        raise Cannot(
            f"not supported: {name}.type {kind!r}: unbroken reads {', '.join(TYPES)}, or a custom type whose prompt "
            "is one field"
        )
    fields: dict[str, Any] = {}
    if base == "completion" and entry.get("field"):
        fields["data.text_field"] = entry["field"]
    if base == "chat_template":
        fields.update(_messages(entry, name))
    return TYPES[base], fields, [TYPE_NOTES[base]]


def _messages(entry: dict[str, Any], name: str) -> dict[str, Any]:
    mapped = dict(entry.get("message_property_mappings") or {})
    mapped.setdefault("role", entry.get("message_field_role", "role"))
    mapped.setdefault("content", entry.get("message_field_content", "content"))
    if any(k != v for k, v in mapped.items()):
        raise Cannot(f"not supported: {name}: messages keyed {mapped}; unbroken reads {{role, content}} messages")
    return {"data.messages_field": entry["field_messages"]} if entry.get("field_messages") else {}


def _custom(kind: dict[str, Any], name: str) -> tuple[str, dict[str, Any], list[str]]:
    """A custom type whose prompt is one field as written (``format: '{instruction}'``) is pairs; a template is not:
    unbroken does not put a prompt together."""
    plain = all(kind.get(k) in (None, "{instruction}") for k in ("format", "no_input_format"))
    if not plain or any(kind.get(k) for k in ("field_input", "field_system", "system_prompt", "system_format")):
        raise Cannot(
            f"not supported: {name}.type: a prompt template ({kind.get('format')!r}): unbroken does not put a prompt "
            "together; write the whole prompt into one field (format: '{instruction}'), or the records as chat "
            "messages (type: chat_template)"
        )
    fields = {"data.input_field": kind.get("field_instruction", "instruction")}
    fields["data.target_field"] = kind.get("field_output", "output")
    return "pairs", fields, [f"{name}.type: a prompt field and a completion field: data.format pairs"]


def run_name(text: str) -> str:
    """``text`` as a valid run name: lowercase letters, digits and '-' (ray_jobs/config/series.py's rule)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "converted"


def number(v: Any, _: Context) -> float:
    try:
        return float(v)  # YAML 1.1 reads ``2e-5`` (no dot) as a string
    except (TypeError, ValueError):
        raise Cannot(f"not supported: {v!r} is not a number") from None


def whole(v: Any, _: Context) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v):
        raise Cannot(f"not supported: {v!r}: unbroken counts whole steps and passes (an int)")
    return int(v)


def steps(v: Any, ctx: Context) -> int | None:
    return None if isinstance(v, int | float) and v <= 0 else whole(v, ctx)  # TRL's -1: not set


def epochs(v: Any, ctx: Context) -> int:
    if _steps_set(ctx):
        raise Cannot("not needed: max_steps is set too, which trains that many steps whatever the epochs (as here)")
    return whole(v, ctx)


def _steps_set(ctx: Context) -> bool:
    """Whether the file sets max_steps (TRL's -1, or none, does not)."""
    n = ctx.source.get("max_steps")
    return isinstance(n, int | float) and not isinstance(n, bool) and n > 0


SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}


def schedule(v: Any, _: Context) -> str:
    if v not in SCHEDULES:  # every schedule of unbroken's warms up first: constant_with_warmup is its constant
        raise Cannot(f"not supported: {v!r}: train.lr_schedule is one of constant, cosine, linear (after warmup)")
    return SCHEDULES[v]


def precision(v: Any, _: Context) -> str | None:
    if v == "auto":
        return "auto"
    return "bf16" if v is True else None


def flag(v: Any, _: Context) -> bool:
    if not isinstance(v, bool):
        raise Cannot(f"not supported: {v!r}: unbroken's field is true or false")
    return v


def adapter(v: Any, _: Context) -> Fields:
    if v == "lora":
        return Fields({"model.lora": {}})
    if v == "qlora":
        return Fields({"model.lora": {}, "model.quantization": "4bit"}, "QLoRA: a 4-bit NF4 base, LoRA adapters on it")
    raise Cannot(f"not supported: adapter {v!r}: unbroken trains LoRA (lora, qlora) or every weight (no adapter)")


def peft(v: Any, _: Context) -> Fields | None:
    return Fields({"model.lora": {}}) if v is True else None


def lora(v: Any, ctx: Context) -> Any:
    if ctx.source.get("adapter") not in ("lora", "qlora") and ctx.source.get("use_peft") is not True:
        raise Cannot("not needed: no LoRA adapter (adapter: lora or qlora; use_peft: true) for it to shape")
    return v


def all_linear(v: Any, ctx: Context) -> str | None:
    return lora("all-linear", ctx) if v is True else None


def four_bit(v: Any, _: Context) -> Fields | None:
    return Fields({"model.quantization": "4bit"}) if v is True else None


def fsdp(v: Any, _: Context) -> str:
    return "fsdp"


def fraction(v: Any, _: Context) -> float:
    if not isinstance(v, int | float) or not 0 <= v < 1:
        raise Cannot(f"not supported: {v!r} records: unbroken holds out a share (data.eval_fraction, 0 <= x < 1)")
    return float(v)


def warmup_ratio(v: Any, ctx: Context) -> int:
    if not _steps_set(ctx):
        raise Cannot("not supported: unbroken warms up for train.warmup_steps; set it to the ratio x the steps")
    return round(number(v, ctx) * ctx.source["max_steps"])  # of max_steps, as HF computes it


def report_to(v: Any, _: Context) -> Fields | None:
    names = [v] if isinstance(v, str) else list(v)
    trackers = {n: f"tracking.{n}" for n in ("tensorboard", "mlflow", "wandb")}
    if names in (["none"], []):
        return None
    others = [n for n in names if n not in trackers]
    why = f"{', '.join(others)}: not supported (unbroken reports to tensorboard, mlflow, wandb)" if others else ""
    if len(others) == len(names):
        raise Cannot(why)
    return Fields({trackers[n]: True for n in names if n in trackers}, why)


def as_run_name(v: Any, _: Context) -> str:
    return run_name(str(v))


def optimizer(v: Any, _: Context) -> None:
    if str(v).startswith("adamw"):
        raise Cannot("not needed: unbroken steps with torch's AdamW (train.lr, train.weight_decay)")
    raise Cannot(f"not supported: {v!r}: unbroken steps with torch's AdamW")


def train_on_inputs(v: Any, _: Context) -> None:
    if v is True:
        raise Cannot("not supported: unbroken learns a record's completion (the assistant's turns), not its prompt")
    raise Cannot("not needed: unbroken masks the prompt from the loss, as train_on_inputs: false does")


def per_epoch(what: str) -> Callable[[Any, Context], Any]:
    """TRL's ``eval_strategy`` / ``save_strategy`` (``what``: eval, save): ``epoch`` is once per pass over the data."""

    def transform(v: Any, _: Context) -> int:
        if v == "epoch":
            return 1
        if v == "steps":
            raise Cannot(f"not needed: unbroken counts in steps ({what}_steps)")
        raise Cannot(f"not supported: {v!r}: unbroken always does {what}s (every so many steps, and at the end)")

    return transform


def wandb_mode(v: Any, _: Context) -> str:
    if v not in ("online", "offline"):
        raise Cannot(f"not supported: {v!r}: tracking.wandb.mode is online or offline (leave W&B out to disable it)")
    return v


def dataset_name(v: Any, ctx: Context) -> Fields:
    source, note = where(str(v), ctx)
    return Fields({"data.train": source, "data.format": "auto"}, f"{note}\nthe records' shape is detected, as TRL does")


def hub_option(option: str) -> Callable[[Any, Context], Any]:
    """TRL's ``dataset_config`` / ``dataset_train_split``: the hub dataset's ``option`` (subset, split), when
    dataset_name is a hub dataset."""

    def transform(v: Any, ctx: Context) -> Any:
        if not isinstance(where(str(ctx.source.get("dataset_name") or ""), ctx)[0], dict):
            raise Cannot(f"not needed: dataset_name is no hub dataset, which is what has a {option}")
        return None if (option, v) == ("split", "train") else v

    return transform
