"""Record shapes: what each ``data.format`` expects of a record, mapped onto the two ways staging trains one.

Every shape ends as a prompt and a target tokenized as one text (the ``pairs`` path) or as a list of ``{role,
content}`` messages rendered by the tokenizer's chat template (the ``chat`` path), so the shapes other tools write
(Alpaca, ShareGPT, TRL's prompt/completion) stage to exactly the bytes their hand-converted ``pairs``/``chat`` file
would. ``auto`` reads the first records of the first train file and names the shape once, before staging: the dataset
id then holds the detected shape, never ``auto``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from ray_jobs.config import DataConfig
from ray_jobs.config.record_formats import FORMATS, record_format
from ray_jobs.data.formats import reader_for
from ray_jobs.data.lines import parse_line
from ray_jobs.data.sources import SourceUnreadable, StagingError, list_sources
from ray_jobs.storage import fs_and_path

log = logging.getLogger("unbroken.staging")


class RecordProblem(ValueError):
    """Why one record cannot be staged (it becomes a Reject; the run goes on)."""


@dataclass
class Shaped:
    """A record on one of the two paths: ``messages`` for the chat template, else ``prompt`` + ``target``. ``shown``:
    the question as a person reads it, where the prompt wraps it in more (the Alpaca preamble)."""

    messages: list[dict] | None = None
    prompt: str = ""
    target: str = ""
    shown: str = ""
    rejected: str = ""  # a preference record's rejected answer (``target`` is the chosen one) ...
    rejected_messages: list[dict] | None = None  # ... or its conversation ending in the rejected reply
    desirable: bool | None = None  # an unpaired preference record's label: its completion desirable or not


# Stanford Alpaca's prompt (github.com/tatsu-lab/stanford_alpaca, train.py), for a tokenizer with no chat template.
ALPACA_HEAD = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)
ALPACA_INPUT_HEAD = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def shape(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """The record ``obj`` under ``data.format`` (resolved: any but ``auto``), by its row in ``SHAPES``; ``templated``:
    the tokenizer has a chat template (decided once per staging, so a file never mixes the two paths for one shape)."""
    if data.format not in SHAPES:
        raise ValueError(f"data.format={data.format} has no record shape (resolve_format names auto's before staging)")
    return SHAPES[data.format](obj, data, templated)


def uses_template(data: DataConfig, tokenizer, name: str) -> bool:
    """Whether this staging renders records with the tokenizer's chat template (the format's ``chat``); a format
    whose records all are conversations fails here without one, before any source is read."""
    has, fmt = bool(getattr(tokenizer, "chat_template", None)), record_format(data.format)
    if fmt.chat == "always" and not has:
        raise StagingError(
            f"data.format={fmt.name} needs a tokenizer with a chat template; the tokenizer of {name} has none "
            f"({fmt.no_template})"
        )
    return has and fmt.chat != "never"


def _missing(key: str, fmt: str | None) -> RecordProblem:
    return RecordProblem(f"missing field {key!r}" + (f" (data.format={fmt})" if fmt else ""))


def string_field(obj: dict, key: str, fmt: str | None = None) -> str:
    """A required non-blank string field; ``fmt`` names the shape in a missing-field message."""
    if key not in obj:
        raise _missing(key, fmt)
    if not isinstance(obj[key], str):
        raise RecordProblem(f"field {key!r} must be a string, got {type(obj[key]).__name__}")
    if not obj[key].strip():
        raise RecordProblem(f"field {key!r} is empty")
    return obj[key]


def optional_string(obj: dict, key: str) -> str:
    """An optional string field; absent, null (a Parquet column's missing value) or blank is ``""``."""
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise RecordProblem(f"field {key!r} must be a string, got {type(value).__name__}")
    return value if value and value.strip() else ""


def message_list(obj: dict, key: str, fmt: str | None = None) -> list[dict]:
    """A non-empty list of ``{role, content}`` messages with string fields and content."""
    if key not in obj:
        raise _missing(key, fmt)
    msgs = obj[key]
    if not isinstance(msgs, list) or not msgs:
        raise RecordProblem(f"field {key!r} must be a non-empty list of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RecordProblem(f"{key}[{i}] must be an object with string 'role' and 'content'")
        if not m["content"].strip():
            raise RecordProblem(f"{key}[{i}] has empty content")
    return msgs


def conversation(msgs: list[dict]) -> list[dict]:
    """Messages that end in the assistant's reply to something: what the chat path learns from."""
    if msgs[-1]["role"] != "assistant":
        raise RecordProblem(f"the last message must be the assistant's (got {msgs[-1]['role']!r})")
    if len(msgs) < 2:
        raise RecordProblem("a conversation needs a message before the assistant's reply")
    return msgs


def _pairs(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """A prompt and its target, in the fields ``data`` names."""
    return Shaped(prompt=string_field(obj, data.input_field), target=string_field(obj, data.target_field))


def _text(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """A document: its text is the target, learned whole (staging cuts a long one into pieces)."""
    return Shaped(target=string_field(obj, data.text_field))


def _chat(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """A list of messages ending in the assistant's reply."""
    return Shaped(messages=conversation(message_list(obj, data.messages_field)))


def _alpaca(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """A chat of the instruction (and input) and the output; with no template, Stanford Alpaca's prompt, whose
    preamble a ``system`` field replaces."""
    instruction, output = string_field(obj, "instruction", "alpaca"), string_field(obj, "output", "alpaca")
    extra, system = optional_string(obj, "input"), optional_string(obj, "system")
    question = instruction + ("\n\n" + extra if extra else "")
    if templated:
        head = [{"role": "system", "content": system}] if system else []
        return Shaped(messages=[*head, {"role": "user", "content": question}, {"role": "assistant", "content": output}])
    preamble = system or (ALPACA_INPUT_HEAD if extra else ALPACA_HEAD)
    body = f"### Instruction:\n{instruction}\n\n" + (f"### Input:\n{extra}\n\n" if extra else "")
    return Shaped(prompt=f"{preamble}\n\n{body}### Response:\n", target=output, shown=question)


def _sharegpt(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """``conversations: [{from, value}]`` as messages (a top-level ``system`` string, as LLaMA-Factory writes it,
    first)."""
    if "conversations" not in obj:
        raise _missing("conversations", "sharegpt")
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        raise RecordProblem("field 'conversations' must be a non-empty list of {from, value} turns")
    system = optional_string(obj, "system")
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise RecordProblem(f"conversations[{i}] must be an object with string 'from' and 'value'")
        if t["from"] not in SHAREGPT_ROLES:
            raise RecordProblem(
                f"conversations[{i}].from is {t['from']!r}; expected one of {', '.join(SHAREGPT_ROLES)}"
            )
        if not t["value"].strip():
            raise RecordProblem(f"conversations[{i}] has empty value")
        msgs.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return Shaped(messages=conversation(msgs))


def _prompt_completion(obj: dict, data: DataConfig, templated: bool, fmt: str = "prompt_completion") -> Shaped:
    """TRL's shape: two strings (a prompt and its completion), or two lists of messages (a conversation)."""
    for key in ("prompt", "completion"):
        if key not in obj:
            raise _missing(key, fmt)
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        if not templated:
            raise RecordProblem(
                "a conversational prompt/completion (lists of messages) needs a tokenizer with a chat template"
            )
        return Shaped(messages=conversation(message_list(obj, "prompt") + message_list(obj, "completion")))
    if isinstance(prompt, str) and isinstance(completion, str):
        return Shaped(prompt=string_field(obj, "prompt"), target=string_field(obj, "completion"))
    raise RecordProblem(
        "fields 'prompt' and 'completion' must both be strings or both lists of messages, got "
        f"{type(prompt).__name__} and {type(completion).__name__}"
    )


def _preference(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """TRL's preference shape: a prompt with a chosen and a rejected answer -- three strings, or three lists of
    messages (the prompt's conversation, then each answer's assistant turn)."""
    keys = ("prompt", "chosen", "rejected")
    for key in keys:
        if key not in obj:
            raise _missing(key, "preference")
    kinds = {type(obj[k]) for k in keys}
    if kinds == {str}:
        p, c, r = (string_field(obj, k) for k in keys)
        return Shaped(prompt=p, target=c, rejected=r)
    if kinds == {list}:
        if not templated:
            raise RecordProblem(
                "a conversational preference record (lists of messages) needs a tokenizer with a chat template"
            )
        p, c, r = (message_list(obj, k) for k in keys)
        return Shaped(messages=conversation(p + c), rejected_messages=conversation(p + r))
    got = ", ".join(type(obj[k]).__name__ for k in keys)
    raise RecordProblem(
        f"fields 'prompt', 'chosen' and 'rejected' must all be strings or all lists of messages, got {got}"
    )


def _unpaired_preference(obj: dict, data: DataConfig, templated: bool) -> Shaped:
    """TRL's unpaired preference shape (KTO's): a prompt and a completion as ``prompt_completion``'s, and a boolean
    ``label``, true when the completion is desirable."""
    shaped = _prompt_completion(obj, data, templated, "unpaired_preference")
    if "label" not in obj:
        raise _missing("label", "unpaired_preference")
    if not isinstance(obj["label"], bool):
        raise RecordProblem(f"field 'label' must be true or false, got {type(obj['label']).__name__}")
    shaped.desirable = obj["label"]
    return shaped


# Each record format's shape (every one of FORMATS but the detected ``auto``): a new format is its row there and here.
SHAPES: dict[str, Callable[[dict, DataConfig, bool], Shaped]] = {
    "pairs": _pairs,
    "text": _text,
    "chat": _chat,
    "alpaca": _alpaca,
    "sharegpt": _sharegpt,
    "prompt_completion": _prompt_completion,
    "preference": _preference,
    "unpaired_preference": _unpaired_preference,
}


# Detection (data.format=auto) ------------------------------------------------------------------------------------

SNIFF_BYTES = 1 << 20  # of a JSONL file read to detect its shape, whatever its size or the length of its lines
SNIFF_RECORDS = 5


def _rules(data: DataConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(format, the fields that tell it), in the order ``auto`` tries them (``FORMATS``'), first match wins."""
    return [(name, fields_of(name, data)) for name, fmt in FORMATS.items() if not fmt.detected]


def fields_of(fmt: str, data: DataConfig) -> tuple[str, ...]:
    """The top-level fields a record of format ``fmt`` must have (as ``data`` names them)."""
    f = record_format(fmt)
    return f.fields + tuple(getattr(data, setting) for setting in f.field_settings)


def shape_of(keys: list[str], data: DataConfig) -> str | None:
    """The format a record with these top-level fields is, by the first rule whose fields it has."""
    return next((fmt for fmt, need in _rules(data) if set(need) <= set(keys)), None)


def resolve_format(data: DataConfig, source: str | None = None, field_name: str = "data.train") -> DataConfig:
    """``data`` with ``format: auto`` replaced by the shape of the first records of ``source`` (``data.train`` by
    default; a copy; ``data`` itself when its format is named). Reads at most ``SNIFF_BYTES`` of one file, or a
    columnar file's schema. ``field_name``: the config field that names ``source``."""
    if not record_format(data.format).detected:
        return data
    if source is None:
        assert isinstance(data.train, str), "a list of sources is resolved source by source (data/mixture.py)"
        source = data.train
    url, samples = sample_fields(source, field_name)
    where, keys = samples[0]
    fmt = shape_of(keys, data)
    said = "" if field_name == "data.train" else f"{field_name}: "
    if fmt is None:
        expected = "; ".join(f"{'+'.join(need)} ({name})" for name, need in _rules(data))
        raise StagingError(
            f"{said}data.format=auto: cannot tell the shape of {url} from the fields of its first record ({where}): "
            f"{', '.join(keys) or 'none'}; expected one of: {expected}. Set data.format"
        )
    for other_where, other_keys in samples[1:]:
        other = shape_of(other_keys, data)
        if other != fmt:
            raise StagingError(
                f"{said}data.format=auto: the records of {url} disagree on their shape: {where} is {fmt}, {other_where} "
                f"is {other or 'none of them'} (fields {', '.join(other_keys) or 'none'}). Set data.format"
            )
    log.info("data.format=auto: detected %s in %s", fmt, url)
    return data.model_copy(update={"format": fmt})


def sample_fields(source: str, field_name: str = "data.train") -> tuple[str, list[tuple[str, list[str]]]]:
    """(file, [(where, top-level fields)]) of the first file of ``source`` (the config's ``field_name``) that has a
    record."""
    for url in list_sources(source, field_name):
        columns = reader_for(url).columns(url)  # a columnar file's schema; records of a text file say their own
        samples = [("its columns", columns)] if columns is not None else _line_keys(url)
        if samples:
            return url, samples
    raise StagingError(f"{field_name}: no record in {source} to tell its shape from")


def _line_keys(url: str) -> list[tuple[str, list[str]]]:
    """Top-level fields of the first ``SNIFF_RECORDS`` objects of a JSONL file, from its first ``SNIFF_BYTES``. A
    line cut short by that limit counts only when it is the first: its fields are read from the prefix."""
    fs, path = fs_and_path(url)
    try:
        head = fs.cat_file(path, start=0, end=SNIFF_BYTES)
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e
    lines = head.split(b"\n")
    out: list[tuple[str, list[str]]] = []
    for lineno, raw in enumerate(lines, start=1):
        if len(out) == SNIFF_RECORDS:
            break
        if not raw.strip():
            continue
        if lineno == len(lines) and len(head) >= SNIFF_BYTES:  # goes on past what was read
            keys = prefix_keys(raw.decode("utf-8", errors="replace"))
            if not out and keys is not None:
                out.append((f"line {lineno}, its first {SNIFF_BYTES} bytes", keys))
            break
        obj, problem = parse_line(raw)
        if problem is None and isinstance(obj, dict):  # else not a record: staging rejects it, naming its line
            out.append((f"line {lineno}", list(obj)))
    return out


_TOKEN = re.compile(r'["{}\[\],]')
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def prefix_keys(text: str) -> list[str] | None:
    """The top-level keys of a JSON object whose text may be cut anywhere (a record too long to read whole); None
    when the text is not an object. Values are skipped, not parsed: a megabyte string costs one regex match."""
    if not text.lstrip().startswith("{"):
        return None
    keys: list[str] = []
    depth, want_key, i = 0, False, 0
    while m := _TOKEN.search(text, i):
        c, i = m.group(), m.end()
        if c == '"':
            s = _STRING.match(text, m.start())
            if s is None:  # cut inside a string
                break
            if depth == 1 and want_key:
                try:
                    keys.append(json.loads(s.group()))
                except ValueError:  # a key with a bad escape: no record, whatever its fields
                    break
                want_key = False
            i = s.end()
        elif c in "{[":
            depth += 1
            want_key = depth == 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                break
        elif depth == 1:  # a comma between top-level members
            want_key = True
    return keys
