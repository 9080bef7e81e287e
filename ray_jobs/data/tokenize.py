"""Tokenizing records the way inference does, and choosing which tokens are learned.

Each record is one text, encoded once by the tokenizer's own rules: ``pairs``/``text`` with its special tokens
(what ``tokenizer(prompt + target)`` gives), ``chat`` without them (the template already wrote them; this is what
``apply_chat_template(tokenize=True)`` does). Learned tokens come from character offsets, so no token boundary
differs from what the model sees when it is asked the prompt alone.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import numpy as np

from ray_jobs.data.records import Record, RecordProblem, Reject, Rendered
from ray_jobs.data.sources import StagingError, position_unit

IGNORE_INDEX = -100
UNREPRESENTABLE = "contains characters the tokenizer cannot represent (would become <unk>)"


class Examples(NamedTuple):
    """Tokenized examples, flat: every example's ids then labels back to back, and each example's length."""

    ids: np.ndarray  # int32 [sum(lengths)]
    labels: np.ndarray  # int32 [sum(lengths)]
    lengths: np.ndarray  # int64 [examples]

    @classmethod
    def of(cls, examples: list[tuple[list[int], list[int]]]) -> Examples:
        ids = [np.asarray(i, dtype=np.int32) for i, _ in examples]
        labels = [np.asarray(lab, dtype=np.int32) for _, lab in examples]
        return cls._join(ids, labels)

    @classmethod
    def _join(cls, ids: list[np.ndarray], labels: list[np.ndarray]) -> Examples:
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        empty = np.empty(0, dtype=np.int32)
        return cls(np.concatenate(ids) if ids else empty, np.concatenate(labels) if labels else empty, lengths)

    @classmethod
    def concat(cls, parts: list[Examples]) -> Examples:
        empty = np.empty(0, dtype=np.int32)
        if not parts:
            return cls(empty, empty, np.empty(0, dtype=np.int64))
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("ids", "labels", "lengths")))

    def slice(self, a: int, b: int) -> Examples:
        """Examples ``a`` to ``b`` (exclusive)."""
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])
        lo, hi = int(bounds[a]), int(bounds[b])
        return Examples(self.ids[lo:hi], self.labels[lo:hi], self.lengths[a:b])

    def as_lists(self) -> list[tuple[list[int], list[int]]]:
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])
        return [
            (self.ids[a:b].tolist(), self.labels[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]


def _rejected(rec: Record) -> Record:
    """A preference record's rejected answer: a staging's records share one format, and ``preference`` requires a
    non-blank rejected answer of each, so every record of a batch whose first has one has one too."""
    assert rec.pair is not None, "a preference record always holds its rejected answer"
    return rec.pair


class Tokenized:
    """Token ids and per-token labels (IGNORE_INDEX where not learned) of records; unfit records become rejects.

    A record's text gets the tokenizer's special tokens unless a chat template wrote it (it holds them already;
    adding them would double BOS). A record longer than ``seq_len`` is handled by ``too_long`` (``data.too_long``):
    rejected, dropped, or truncated (:mod:`ray_jobs.data.fit`, which needs the chat ``render`` for conversations).
    Per record the work is numpy over its tokens (no Python loop per token): staging tokenizes every record once.
    """

    def __init__(self, tokenizer, records: list[Record], seq_len: int, too_long: str = "reject", render=None):
        if tokenizer.eos_token_id is None:
            raise StagingError("the tokenizer has no EOS token; unbroken needs one to end each example")
        self.tokenizer, self.seq_len, self.too_long, self.render = tokenizer, seq_len, too_long, render
        self.eos, self.eos_text, self.unk = tokenizer.eos_token_id, tokenizer.eos_token, tokenizer.unk_token_id
        self.rejects: list[Reject] = []
        self.truncated = 0
        kept_ids, kept_labels = [], []
        if records and records[0].pair is not None:  # preference records: chosen and rejected, kept or rejected whole
            both = [r for rec in records for r in (rec, _rejected(rec))]
            kept_ids, kept_labels = self._fit_pairs(records, encode_records(tokenizer, both))
        else:
            for rec, (ids, offsets) in zip(records, encode_records(tokenizer, records), strict=True):
                example = self._fitted(rec, *self._example(rec, ids, offsets))
                if example is not None:
                    kept_ids.append(example[0])
                    kept_labels.append(example[1] if rec.desirable is not False else coded_undesirable(example[1]))
        self.flat = Examples._join(kept_ids, kept_labels)

    def _fitted(self, rec: Record, ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The example as it is staged, or None when it became a reject (or a dropped record)."""
        if self.unk is not None and bool((ids == self.unk).any()):
            return self._reject(rec, UNREPRESENTABLE)
        if len(ids) <= self.seq_len:
            return ids, labels
        problem = f"record is {len(ids)} tokens, longer than data.seq_len ({self.seq_len})"
        if self.too_long == "reject":
            return self._reject(rec, problem)
        if self.too_long == "truncate" and rec.desirable is not None:  # cut short, it may not be what its label says
            return self._reject(rec, f"{problem} (data.too_long=truncate cannot cut a labelled completion: rejected)")
        if self.too_long == "truncate":
            from ray_jobs.data.fit import truncate

            fitted, why = truncate(self, rec)
            if fitted is not None:
                self.truncated += 1
                return fitted
            problem += f", and {why}"
        return self._reject(rec, f"{problem}; dropped (data.too_long={self.too_long})", dropped=True)

    def _fit_pairs(self, records: list[Record], encoded: list) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The examples of preference ``records`` (``encoded``: every record's chosen then rejected text), chosen then
        rejected for each kept record (``ray_jobs.data.preference``); a record either of whose answers does not fit
        (or holds an unrepresentable character) is rejected whole, naming which answer."""
        ids, labels = [], []
        for k, rec in enumerate(records):
            pair = [self._example(r, *encoded[2 * k + j]) for j, r in enumerate((rec, _rejected(rec)))]
            problem = next(
                filter(
                    None, (self._pair_problem(*x, side) for x, side in zip(pair, ("chosen", "rejected"), strict=True))
                ),
                None,
            )
            if problem:
                if self.too_long == "truncate" and "longer than" in problem:
                    problem += " (data.too_long=truncate cannot cut a preference pair: rejected)"
                dropped = self.too_long == "drop" and "longer than" in problem
                self._reject(rec, problem + (f"; dropped (data.too_long={self.too_long})" if dropped else ""), dropped)
                continue
            ids += [x[0] for x in pair]
            labels += [x[1] for x in pair]
        return ids, labels

    def _pair_problem(self, ids: np.ndarray, labels: np.ndarray, side: str) -> str | None:
        if self.unk is not None and bool((ids == self.unk).any()):
            return f"the {side} answer {UNREPRESENTABLE}"
        if len(ids) > self.seq_len:
            return f"prompt + {side} answer is {len(ids)} tokens, longer than data.seq_len ({self.seq_len})"
        if not bool((labels != IGNORE_INDEX).any()):
            return f"the {side} answer has no tokens"
        return None

    def _reject(self, rec: Record, reason: str, dropped: bool = False) -> None:
        self.rejects.append(Reject(rec.file, rec.line, reason, rec.text[:200], position_unit(rec.file), dropped))

    def example(self, rec: Record) -> tuple[np.ndarray, np.ndarray]:
        """One record's (ids, labels), as a batch would give them."""
        ((ids, offsets),) = encode_records(self.tokenizer, [rec])
        return self._example(rec, ids, offsets)

    @property
    def examples(self) -> list[tuple[list[int], list[int]]]:
        """The kept examples as ``(ids, labels)`` lists."""
        return self.flat.as_lists()

    def _example(self, rec: Record, ids: list[int], offsets: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        learn = list(rec.learn)
        eos = self._needs_eos(rec.text, ids)
        if eos and learn and learn[-1][1] >= len(rec.text.rstrip()):
            # the EOS we add ends the final reply, so whitespace the template left before it is part of the reply
            learn[-1] = (learn[-1][0], len(rec.text))
        arr = np.asarray(ids + [self.eos] if eos else ids, dtype=np.int32)
        mask = learned_mask_array(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), learn)
        if eos:  # the final reply is always learned, and so is the EOS that ends it
            mask = np.append(mask, True)
        return arr, np.where(mask, arr, np.int32(IGNORE_INDEX)).astype(np.int32)

    def _needs_eos(self, text: str, ids: list[int]) -> bool:
        """Whether the text still lacks an EOS: one the tokenizer added, or one the text (a template) wrote itself."""
        return not (ids[-1:] == [self.eos] or text.rstrip().endswith(self.eos_text))


def coded_undesirable(labels: np.ndarray) -> np.ndarray:
    """An undesirable completion's labels on their way to its packer (``ray_jobs.data.unpaired``, which stores the
    label in the row): each learned token ``t`` as ``IGNORE_INDEX - 1 - t``, neither a token id nor IGNORE_INDEX."""
    return np.where(labels != IGNORE_INDEX, IGNORE_INDEX - 1 - labels, labels).astype(np.int32)


def learned_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: whether its characters overlap a learned [start, end) span (a token straddling a boundary is
    learned). A token with no characters (a special token the tokenizer inserts, like BOS) follows the one before it."""
    out, prev = [], False
    for s, e in offsets:
        if s < e:
            prev = any(e > a and s < b for a, b in spans)
        out.append(prev)
    return out


def learned_mask_array(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """:func:`learned_mask` over an ``[n, 2]`` offsets array, in numpy (what staging runs; the same answer)."""
    start, end = offsets[:, 0], offsets[:, 1]
    hit = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        hit |= (end > a) & (start < b)
    last_real = np.where(start < end, np.arange(len(offsets)), -1)
    np.maximum.accumulate(last_real, out=last_real)
    return np.where(last_real >= 0, hit[np.maximum(last_real, 0)], False)


def encode_records(tokenizer, records: list[Record]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) per record: a chat template's rendering as it is, other text with the tokenizer's
    special tokens."""
    out: list = [None] * len(records)
    for templated in (False, True):
        idx = [i for i, r in enumerate(records) if r.templated == templated]
        for i, enc in zip(idx, _encode(tokenizer, [records[i].text for i in idx], not templated), strict=True):
            out[i] = enc
    return out


def _encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) per text, batched; a fast tokenizer's Rust backend is called directly (it parallelises
    across cores, and skips transformers' per-record conversion into dicts). Same ids as ``tokenizer(texts)``."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
    try:
        enc = tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except NotImplementedError as e:
        raise StagingError("staging needs a fast tokenizer (one that reports character offsets)") from e
    return list(zip(enc["input_ids"], enc["offset_mapping"], strict=True))


def tokenizer_fingerprint(tokenizer) -> str:
    """Everything of the tokenizer that changes staged ids: its rules, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True)
    template = json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256((body + specials + template).encode()).hexdigest()


def chat_renderer(tokenizer, name: str, train_on: str = "all_assistant"):
    """A function rendering a conversation once with the chat template and finding its learned assistant turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise StagingError(
            f"data.format=chat needs a tokenizer with a chat template; the tokenizer of {name} has none "
            "(use data.format=pairs, or a model whose tokenizer_config.json has a chat_template)"
        )

    def template(msgs: list[dict], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    def render(msgs: list[dict]) -> Rendered:
        text = template(msgs)
        # an assistant message that opens the conversation has no prompt to render: it is context, not learned
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
        if train_on == "last_assistant":
            turns = turns[-1:]
        found = [_turn_span(template, msgs, i, text) for i in turns]
        return Rendered(text, [span for _, span in found], found[-1][0])

    return render


def _turn_span(template, msgs: list[dict], i: int, text: str) -> tuple[str, tuple[int, int]]:
    """(prompt, learned span) of assistant turn ``i`` in the whole rendering ``text``.

    The turn is what rendering ``msgs[:i+1]`` adds to rendering ``msgs[:i]`` with the generation prompt; its learned
    part ends at its last non-whitespace character (for ChatML: right after ``<|im_end|>``, not the newline after it).
    """
    prompt = template(msgs[:i], True)
    full = text if i == len(msgs) - 1 else template(msgs[: i + 1])
    if not full.startswith(prompt):
        raise RecordProblem(
            f"messages[{i}]: the chat template's rendering of this turn does not start with its generation prompt"
        )
    if not text.startswith(full):
        raise RecordProblem(
            f"messages[{i}]: the chat template renders this assistant turn differently once later turns follow, so it "
            "cannot be learned as the model will see it; set data.train_on=last_assistant"
        )
    return prompt, (len(prompt), len(prompt) + len(full[len(prompt) :].rstrip()))
