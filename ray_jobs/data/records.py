"""Validating records: each line (or row) of a source becomes a :class:`Record` or a :class:`Reject`, none is lost.

A Record carries the exact text that is tokenized and the character spans of it the model learns, so tokenizing is
the same for every format: ``pairs`` is prompt + target as one text (the target learned), ``text`` is learned whole,
``chat`` is the conversation rendered once by the tokenizer's chat template (the assistant turns learned). The
shapes other tools write become a ``pairs`` or a ``chat`` record (:mod:`ray_jobs.data.shapes`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict

from ray_jobs.config import DataConfig
from ray_jobs.config.record_formats import record_format
from ray_jobs.data.formats import reader_for
from ray_jobs.data.lines import LongLine, capped, parse_line
from ray_jobs.data.shapes import RecordProblem, shape  # RecordProblem: imported from here too
from ray_jobs.data.sources import SourceBatch, SourceFile, position_unit
from ray_jobs.secrets import mask

# data.max_record_chars when unset, for records that are not text documents (those are cut into pieces instead)
DEFAULT_MAX_RECORD_CHARS = 100_000


@dataclass
class Rendered:
    """A conversation rendered by a chat template: its text, learned spans, and the prompt before the final reply."""

    text: str
    learn: list[tuple[int, int]]
    prompt: str


@dataclass
class Record:
    """One valid record. ``prompt``/``target`` are the question and the expected answer (for ``chat``: the rendered
    conversation before the final reply, generation prompt included, and that reply's content); the eval split
    hashes them and reports generate from ``prompt``. ``text`` is what is tokenized; ``learn`` its learned
    [start, end) character spans. ``shown``: the question as a person reads it, where ``prompt`` is not that (a
    chat's message before the final reply)."""

    file: str
    line: int
    prompt: str
    target: str
    text: str = ""
    learn: list[tuple[int, int]] = field(default_factory=list)
    split: str = "train"
    shown: str = ""
    messages: list[dict] | None = None  # a conversation's messages (``data.too_long=truncate`` renders fewer)
    templated: bool = False  # ``text`` was written by the chat template, special tokens included
    pair: Record | None = None  # a preference record's rejected answer (this one holds the chosen)
    desirable: bool | None = None  # an unpaired preference record's label (None: a record of another format)


class RejectJson(TypedDict, total=False):
    """A reject as ``rejects.jsonl`` holds it: where (``line`` of a JSONL file, or ``row`` of a Parquet one), why,
    and the record's text; ``dropped`` only when it is."""

    file: Required[str]
    line: int
    row: int
    reason: Required[str]
    text: str
    dropped: bool


@dataclass
class Reject:
    file: str
    line: int  # 1-based line of a JSONL file, or row of a Parquet file (see ``unit``)
    reason: str
    text: str = ""
    unit: str = "line"
    dropped: bool = False  # over-long, and ``data.too_long`` drops it: listed, not counted against the reject limit

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file}:row {self.line}"

    def to_json(self) -> RejectJson:
        # rejects.jsonl names the source file masked (a URL's credentials are never written); the record's own
        # text is the data's, quoted as it is
        file = mask(self.file, ())
        out: RejectJson = (
            {"file": file, "row": self.line, "reason": self.reason, "text": self.text}
            if self.unit == "row"
            else {"file": file, "line": self.line, "reason": self.reason, "text": self.text}
        )
        if self.dropped:
            out["dropped"] = True
        return out

    @classmethod
    def from_json(cls, obj: RejectJson) -> Reject:
        row = obj.get("row")
        where, unit = (row, "row") if row is not None else (obj["line"], "line")
        return cls(obj["file"], where, obj["reason"], obj.get("text", ""), unit, obj.get("dropped", False))


Renderer = Callable[[list[dict]], Rendered]


def parse_records(
    src: SourceFile, data: DataConfig, split: str = "train", render: Renderer | None = None
) -> tuple[list[Record], list[Reject]]:
    """Check every record of one source file held in memory; each becomes a Record or a Reject, none is lost.

    ``render`` renders chat messages with the tokenizer's chat template; only ``chat`` needs it.
    """
    if position_unit(src.url) == "row":
        objects = _rows(src)
    else:
        limit = record_char_limit(data)
        objects = line_objects((n, capped(raw, limit)) for n, raw in enumerate(src.data.split(b"\n"), start=1))
    return check_objects(objects, src.url, data, split, render)


def record_char_limit(data: DataConfig) -> int | None:
    """``data.max_record_chars``; unset, its default for records that are not documents (those have none: they are
    cut into pieces)."""
    if data.max_record_chars is None and not record_format(data.format).documents:
        return DEFAULT_MAX_RECORD_CHARS
    return data.max_record_chars


def check_objects(
    objects: Iterable[tuple[int, Any, str | None, str]], url: str, data: DataConfig, split: str, render: Renderer | None
) -> tuple[list[Record], list[Reject]]:
    """Records and rejects of decoded objects ``(position, object, problem, preview)`` of source file ``url``."""
    records: list[Record] = []
    rejects: list[Reject] = []
    unit = position_unit(url)
    for pos, obj, problem, preview in objects:
        try:
            if problem:
                raise RecordProblem(problem)
            records.append(_record(obj, data, render, url, pos, split))
        except RecordProblem as e:
            rejects.append(Reject(url, pos, str(e), preview, unit))
    return records, rejects


def batch_records(
    batch: SourceBatch, data: DataConfig, split: str, render: Renderer | None
) -> tuple[list[Record], list[Reject]]:
    """Records and rejects of one batch of a source file (see ``sources.read_batches``)."""
    objects = row_objects(batch.items) if position_unit(batch.url) == "row" else line_objects(batch.items)
    return check_objects(objects, batch.url, data, split, render)


def line_objects(lines: Iterable[tuple[int, bytes | LongLine]]) -> Iterator[tuple[int, Any, str | None, str]]:
    """(line number, object, problem, preview) of JSONL lines; blank lines are not records."""
    for lineno, raw in lines:
        if isinstance(raw, LongLine):  # over the cap: never read whole, so not parsed either
            yield lineno, None, raw.reason, raw.head[:200].decode("utf-8", errors="replace")
            continue
        if not raw.strip():
            continue
        obj, problem = parse_line(raw)
        yield lineno, obj, problem, raw[:200].decode("utf-8", errors="replace")


def row_objects(rows: Iterable[tuple[int, dict]]) -> Iterator[tuple[int, Any, None, str]]:
    """(row number, row, None, preview) of a columnar file's rows."""
    for i, row in rows:
        yield i, row, None, json.dumps(row, default=str)[:200]


def _rows(src: SourceFile) -> Iterator[tuple[int, Any, None, str]]:
    yield from row_objects(enumerate(reader_for(src.url).rows(src), start=1))


def _record(obj: Any, data: DataConfig, render: Renderer | None, file: str, pos: int, split: str) -> Record:
    """The Record of one decoded object under ``data.format`` (resolved: never ``auto``); raises RecordProblem. A
    ``render`` (the chat template) puts every conversation, and alpaca records, on the chat path; a document is a
    target with no prompt, learned whole."""
    if not isinstance(obj, dict):
        raise RecordProblem(f"expected a JSON object, got {type(obj).__name__}")
    s = shape(obj, data, render is not None)
    rec = _shaped(s.messages, s.prompt, s.target, s.shown, render, file, pos, split)
    if s.rejected or s.rejected_messages:
        rec.pair = _shaped(s.rejected_messages, s.prompt, s.rejected, s.shown, render, file, pos, split)
    rec.desirable = s.desirable
    limit, chars = record_char_limit(data), len(rec.text) + (len(rec.pair.text) if rec.pair else 0)
    if limit is not None and chars > limit:
        raise RecordProblem(f"record is {chars} characters, over data.max_record_chars ({limit})")
    return rec


def _shaped(
    msgs: list[dict] | None,
    prompt: str,
    target: str,
    shown: str,
    render: Renderer | None,
    file: str,
    pos: int,
    split: str,
) -> Record:
    """The Record of a shaped record: a conversation rendered by the chat template, else prompt + target."""
    if msgs is not None:
        r = _render(render, msgs)
        return Record(
            file,
            pos,
            r.prompt,
            msgs[-1]["content"],
            r.text,
            r.learn,
            split,
            shown=msgs[-2]["content"],
            messages=msgs,
            templated=True,
        )
    end = len(prompt) + len(target)
    return Record(file, pos, prompt, target, prompt + target, [(len(prompt), end)], split, shown)


def _render(render: Renderer | None, msgs: list[dict]) -> Rendered:
    if render is None:
        raise ValueError("a conversation: parse_records needs the chat template renderer")
    try:
        return render(msgs)
    except RecordProblem:
        raise
    except Exception as e:  # a template error names the record, not the whole run
        raise RecordProblem(f"chat template failed: {e}") from e


def record_in_eval(rec: Record, eval_fraction: float) -> bool:
    """Hash split: a record's side depends only on its content, so adding records never reshuffles."""
    h = hashlib.sha256(f"{rec.prompt}\0{rec.target}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < eval_fraction
