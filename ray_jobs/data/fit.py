"""``data.too_long: truncate``: fitting an over-long prompt/completion or chat record into ``seq_len`` tokens.

The rule, in order:
1. A conversation drops its earliest exchanges first (a user message and the replies after it; system messages
   stay), keeping its final assistant turn whole, as long as one exchange is left: the final reply is what the
   record is for, and a turn cut short teaches less than a turn left out.
2. Then the final reply (a chat's last assistant message, a pair's target) is cut from its end, to the longest
   prefix that fits -- re-rendered by the chat template, so the end-of-turn marker the template writes (``<|im_end|>``
   for ChatML; a pair's EOS) is still there and still learned: a truncated reply must still teach the model to stop
   rather than to run on past ``seq_len``.
3. When not even one character of the reply fits after the prompt, the record cannot be truncated; it is dropped
   (listed with the reason), never staged with nothing learned.

Each attempt is re-rendered and re-tokenized as a record of its own (so the tokens are exactly what that shorter
record would give); the cut is found by bisection over the reply's characters, a few dozen encodes for the few
records that need it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ray_jobs.data.records import Record, RecordProblem

Example = tuple[np.ndarray, np.ndarray]
Tokenized = Any  # tokenize.Tokenized (its seq_len, render and example()); named so, tokenize imports this module


def truncate(tok: Tokenized, rec: Record) -> tuple[Example | None, str]:
    """The record fitted into ``tok.seq_len`` tokens by the module's rule, or (None, why it cannot be)."""
    if rec.messages is not None:
        if tok.render is None:
            return None, "no chat template renderer to truncate it with"
        for shorter in _fewer_exchanges(rec.messages):
            fewer = _chat(tok, rec, shorter)
            if fewer is None:
                return None, "the chat template cannot render it with fewer turns"
            rec = fewer  # the reply is cut from the shortest conversation tried
            ids, labels = tok.example(rec)
            if len(ids) <= tok.seq_len:
                return (ids, labels), ""
    elif rec.text != rec.prompt + rec.target:
        return None, "it is not a prompt and a reply that could be cut"
    return _cut_reply(tok, rec)


def _fewer_exchanges(msgs: list[dict]) -> list[list[dict]]:
    """The conversation without its first exchange, then without its first two, ... down to its last exchange."""
    system = [m for m in msgs[: _first_turn(msgs)] if m["role"] == "system"]
    starts = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    return [system + msgs[i:] for i in starts[1:]]


def _first_turn(msgs: list[dict]) -> int:
    return next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))


def _cut_reply(tok: Tokenized, rec: Record) -> tuple[Example | None, str]:
    """The longest prefix of the final reply that fits (bisection: tokens grow with characters)."""
    reply = rec.target
    lo, hi, best = 1, len(reply) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        shorter = _with_reply(tok, rec, reply[:mid])
        example = tok.example(shorter) if shorter is not None else None
        if example is not None and len(example[0]) <= tok.seq_len:
            best, lo = example, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return None, "its prompt leaves no room for one token of the reply"
    return best, ""


def _with_reply(tok: Tokenized, rec: Record, reply: str) -> Record | None:
    if rec.messages is not None:
        msgs = [*rec.messages[:-1], {**rec.messages[-1], "content": reply}]
        return _chat(tok, rec, msgs)
    return replace(rec, target=reply, text=rec.prompt + reply, learn=[(len(rec.prompt), len(rec.prompt) + len(reply))])


def _chat(tok: Tokenized, rec: Record, msgs: list[dict]) -> Record | None:
    try:
        r = tok.render(msgs)
    except RecordProblem:
        return None
    except Exception:  # a template that refuses this shorter conversation (e.g. it must start with a user turn)
        return None
    return replace(rec, prompt=r.prompt, target=msgs[-1]["content"], text=r.text, learn=r.learn, messages=msgs)
