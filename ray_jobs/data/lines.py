"""JSONL lines: the lines of a byte range of a file, read a block at a time, and one line made an object.

A line is held only up to a cap derived from ``data.max_record_chars`` (:func:`line_byte_cap`): a longer one is a
:class:`LongLine`, its size and first bytes, that staging rejects naming its line however long it is, without ever
holding it. A line is parsed only once a scan of its brackets showed it nests at most ``MAX_JSON_DEPTH`` deep. So
no line, however long or deep, costs more than a block plus the cap of memory, or fails a staging.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_SCAN = 1 << 16  # bytes read at a time looking for a line's end past a range
_BLOCK = 1 << 20  # bytes read at a time within a range

# A character of a JSON string takes at most 12 bytes of JSONL: one outside the BMP written as an escaped surrogate
# pair (\ud83d\ude00; raw UTF-8 is 4, a BMP escape 6). So a record of N characters is at most 12 * N bytes of the
# strings it is made of, and the slack holds its field names and punctuation many times over (and a few small fields
# staging does not read). Only a line whose bytes are mostly something else (a big field staging does not read,
# thousands of near-empty messages, whitespace between tokens) can be over the cap with a record within the limit;
# its reject names the limit to raise. A line over the cap is rejected without being read whole.
JSON_BYTES_PER_CHAR = 12
LINE_SLACK_BYTES = 1 << 20
PREVIEW_BYTES = 200  # of a line kept for its reject


def line_byte_cap(max_chars: int) -> int:
    """The longest JSONL line (bytes) a record of at most ``max_chars`` characters can be written as."""
    return JSON_BYTES_PER_CHAR * max_chars + LINE_SLACK_BYTES


@dataclass(frozen=True)
class LongLine:
    """A JSONL line longer than ``line_byte_cap(max_chars)``: its size and first bytes, never its whole content."""

    size: int
    head: bytes
    max_chars: int

    @property
    def reason(self) -> str:
        return (
            f"line is {self.size} bytes, over the {line_byte_cap(self.max_chars)}-byte limit for "
            f"data.max_record_chars={self.max_chars}"
        )


def capped(raw: bytes, max_chars: int | None) -> bytes | LongLine:
    """A line held whole, as a LongLine when it is over the cap for ``max_chars`` (None: no cap)."""
    if max_chars is None or len(raw) <= line_byte_cap(max_chars):
        return raw
    return LongLine(len(raw), raw[:PREVIEW_BYTES], max_chars)


def line_range(f, start: int, stop: int | None, max_chars: int | None = None) -> tuple[list[tuple[int, Any]], int]:
    """Lines that begin in [start, stop), the last one read past ``stop`` to its newline (Hadoop's rule for
    splitting text: every line belongs to exactly one range, whoever reads the neighbours)."""
    at = start
    if start > 0:
        f.seek(start - 1)
        if f.read(1) != b"\n":  # mid-line: that line belongs to the range before
            while True:
                block = f.read(_SCAN)
                cut = block.find(b"\n")
                if cut >= 0:
                    at += cut + 1
                    break
                at += len(block)
                if not block:
                    return [], at
    if stop is not None and at >= stop:
        return [], at
    lines, end = [], at
    for end, line in _lines(f, at, stop, max_chars):
        lines.append(line)
        if stop is not None and end >= stop:  # the next line begins in the next range
            break
    return list(enumerate(lines, start=1)), end


def _lines(f, at: int, stop: int | None, max_chars: int | None) -> Iterator[tuple[int, bytes | LongLine]]:
    """``(offset after it, line)`` of each line from byte ``at`` (a line's start) on, read a block at a time: blocks
    of ``_BLOCK`` up to ``stop``, of ``_SCAN`` past it (only the last line is read there). A line over the cap is
    counted, not kept: memory is a block plus the cap, whatever the line's length."""
    cap = None if max_chars is None else line_byte_cap(max_chars)
    f.seek(at)
    pos, begin, line = at, at, _Partial(cap)
    while True:
        block = f.read(_BLOCK if stop is None else min(_BLOCK, stop - pos) if pos < stop else _SCAN)
        if not block:
            if line.size:  # a last line with no newline after it
                yield begin + line.size, line.take(max_chars)
            return
        pos += len(block)
        *ends, tail = block.split(b"\n")
        if ends:  # the first ends the line held from earlier blocks; the others lie whole in this block
            line.add(ends[0])
            begin += line.size + 1
            yield begin, line.take(max_chars)
            for raw in ends[1:]:
                begin += len(raw) + 1
                yield begin, raw if cap is None or len(raw) <= cap else capped(raw, max_chars)
            line = _Partial(cap)
        line.add(tail)


class _Partial:
    """A line being read block by block: its blocks while within ``cap`` bytes, only its first bytes once over."""

    def __init__(self, cap: int | None):
        self.cap, self.parts, self.size, self.over = cap, [], 0, False

    def add(self, part: bytes) -> None:
        self.size += len(part)
        if self.over:
            if len(self.parts[0]) < PREVIEW_BYTES:
                self.parts[0] += part[: PREVIEW_BYTES - len(self.parts[0])]
            return
        self.parts.append(part)
        if self.cap is not None and self.size > self.cap:
            self.parts, self.over = [b"".join(p[:PREVIEW_BYTES] for p in self.parts)[:PREVIEW_BYTES]], True

    def take(self, max_chars: int | None) -> bytes | LongLine:
        if self.over:
            assert max_chars is not None, "a line is over only under a cap, and the cap comes from max_chars"
            return LongLine(self.size, self.parts[0], max_chars)
        return b"".join(self.parts)


# Deeper than this, a line is rejected before it is parsed. Records are a few levels deep (a chat: 3); the
# interpreter's recursion limit (json.loads recurses per level) is ~1000 minus what is already on the stack, so
# catching RecursionError would make a line of depth 990 a record in one process and a reject in another. 128 is
# serde_json's default.
MAX_JSON_DEPTH = 128
# a string, closed or running to the end: once a quote opens one it always matches, so one pass, never a retry from
# every quote (a closed-only pattern is quadratic in a line of escaped quotes with no closing one)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def parse_line(raw: bytes) -> tuple[Any, str | None]:
    """``(object, None)`` of a JSONL line, or ``(None, why it is not one)``: invalid UTF-8, nested too deep, or
    invalid JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    if _too_deep(raw):
        return None, f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} (column {e.colno})"


def _too_deep(raw: bytes) -> bool:
    """Whether a JSON text nests deeper than ``MAX_JSON_DEPTH``, from its brackets outside strings (no parsing, no
    recursion: a line of 100,000 ``[`` is answered at the 129th)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False  # cannot nest deeper than it opens: nearly every record is answered by two counts
    depth = 0
    for c in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):  # brackets in strings are text
        depth += 1 if c in b"[{" else -1
        if depth > MAX_JSON_DEPTH:
            return True
    return False
