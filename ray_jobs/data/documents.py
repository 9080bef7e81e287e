"""``text`` documents of any length: tokenized in windows and cut into pieces of at most ``seq_len`` tokens.

A document is the tokens ``T`` its whole text encodes to (the tokenizer's special tokens around it, an EOS at its
end). Up to ``seq_len`` tokens it is one example, as any record. Longer, it is cut into pieces: the first is
``T[0:seq_len]``, and each next one repeats the last ``max(1, data.text_overlap_tokens)`` tokens of the one before as
context (not learned) and goes on with new tokens. So every token but the document's first is learned exactly once
(nothing precedes the first; no record learns its first token), a piece's tokens are one contiguous run of one
document, and the pieces of a document come out in order. Hugging Face's ``run_clm`` (``group_texts``) and Axolotl's
``completion`` type cut the same way; the one repeated token is what lets a piece learn its first new token.

Positions restart at 0 in every piece, as in ``group_texts``: a piece attends only to itself (the packer gives each
example its own positions and so its own causal block), so continuing the document's positions would claim context
the model never sees, and would run past the positions a model was trained on (a 200k-token document against
SmolLM2's 8k) where a rotary model's behaviour is untrained and an absolute-position model has no embedding at all.

Memory: a document longer than ``WINDOW_CHARS`` is encoded a window at a time, never whole -- the fast tokenizer's
encoding of 100 MB of text would be several GB of Rust and Python objects. A window is cut where a token starts at a
space between two non-space characters (a pre-token boundary for byte-level BPE, WordPiece, Metaspace and
character tokenizers alike), failing that at a newline, failing that at any token boundary, and the next window
starts there. Each cut is checked: the tokens after it must be the ones the previous window produced with right
context, or the document is rejected rather than staged with tokens a whole-document encoding would not give. Its
pieces leave the worker a chunk at a time (:class:`DocSink`: a file in the spill folder, or Ray's object store on a
cluster), so neither the worker nor the staging process ever holds the document's token list: memory is the text
(the JSON line and its decoded string) plus one window.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ray_jobs.data.records import Record, RecordProblem
from ray_jobs.data.tokenize import IGNORE_INDEX, UNREPRESENTABLE, Examples

WINDOW_CHARS = 256 * 1024  # a longer document is encoded a window at a time and its pieces streamed out
BACKOFF_CHARS = 8 * 1024  # a window's cut is sought this far before its end (the tokens past it lack right context)
CHECK_CHARS = 2 * 1024  # the tokens this far past a cut are compared between the two windows
SINK_TOKENS = 1 << 20  # pieces are handed on a chunk of about this many tokens at a time


@dataclass
class DocPieces:
    """The pieces of one long document, held outside the worker: chunks of Examples in a file or in Ray objects."""

    path: str | None = None
    refs: list = field(default_factory=list)
    chunks: int = 0
    pieces: int = 0
    tokens: int = 0

    def read(self) -> Iterator[Examples]:
        """The chunks in order, one in memory at a time."""
        if self.path is None:
            import ray

            for ref in self.refs:
                yield ray.get(ref)
            return
        with open(self.path, "rb") as f:
            for _ in range(self.chunks):
                yield Examples(np.load(f), np.load(f), np.load(f))

    def discard(self) -> None:
        if self.path is not None:
            Path(self.path).unlink(missing_ok=True)
        self.refs = []


class DocSink:
    """Where a worker puts a long document's pieces: ``folder`` on this machine, or (None) Ray's object store."""

    def __init__(self, folder: str | None):
        self.folder = folder
        self.out = DocPieces()
        self._file = None

    def open(self) -> None:
        self.out = DocPieces()
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
            self.out.path = os.path.join(self.folder, f"doc-{uuid.uuid4().hex}.npy")
            self._file = open(self.out.path, "wb")  # noqa: SIM115 -- written chunk by chunk, closed in close()

    def put(self, ex: Examples) -> None:
        if not len(ex.lengths):
            return
        self.out.chunks += 1
        self.out.pieces += len(ex.lengths)
        self.out.tokens += int(ex.lengths.sum())
        if self._file is None:
            import ray

            self.out.refs.append(ray.put(ex))
        else:
            for a in ex:
                np.save(self._file, a)

    def close(self) -> DocPieces:
        if self._file is not None:
            self._file.close()
            self._file = None
        return self.out


class Cutter:
    """Cuts a document's token stream into pieces (module docstring); ``skip`` leading tokens are not learned."""

    def __init__(self, seq_len: int, overlap: int, skip: int = 0):
        self.seq_len, self.context = seq_len, max(1, overlap)
        self.buf = np.empty(0, dtype=np.int32)
        self.unlearned = skip  # tokens at the start of ``buf`` that are context (or the tokenizer's prefix)

    def feed(self, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The pieces these tokens complete (a piece is emitted once a token after it is known)."""
        self.buf = np.concatenate([self.buf, ids.astype(np.int32, copy=False)])
        out = []
        while len(self.buf) > self.seq_len:
            out.append(self._piece(self.buf[: self.seq_len]))
            self.buf = self.buf[self.seq_len - self.context :].copy()
            self.unlearned = self.context
        return out

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self._piece(self.buf)] if len(self.buf) > self.unlearned or not self.unlearned else []

    def _piece(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        labels = ids.copy()
        labels[: self.unlearned] = IGNORE_INDEX
        return ids.copy(), labels


def special_edges(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids the tokenizer adds before and after a text (its post-processor's BOS/EOS, if any)."""
    backend = tokenizer.backend_tokenizer
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []  # a post-processor that rewrites the text's own tokens: add nothing around the windows


def window_tokens(tokenizer, text: str) -> Iterator[list[int]]:
    """The tokens of ``text`` (no special tokens) a window at a time, as whole-text encoding gives them."""
    backend = tokenizer.backend_tokenizer
    a, expect = 0, None
    while True:
        b = min(len(text), a + WINDOW_CHARS)
        enc = backend.encode(text[a:b], add_special_tokens=False)
        ids = enc.ids
        if expect is not None and ids[: len(expect)] != expect:
            raise RecordProblem(
                f"this document's tokens at character {a} change when it is encoded in windows (the tokenizer "
                "joins tokens across the cut), so it cannot be staged exactly"
            )
        if b == len(text):
            yield ids
            return
        k = _cut(enc, text, a, b)
        start = a + enc.token_to_chars(k - 1)[1]
        expect = []
        for i in range(k, len(ids)):
            if enc.token_to_chars(i)[1] > start - a + CHECK_CHARS:
                break
            expect.append(ids[i])
        yield ids[:k]
        a = start


def _cut(enc, text: str, a: int, b: int) -> int:
    """Index (at least 1) of the token window ``text[a:b]`` is cut before; the next window starts at its text."""
    lo, hi = a + (b - a) // 2, b - BACKOFF_CHARS
    for sep, good in ((" ", _space_cut), ("\n", _newline_cut)):
        at = text.rfind(sep, lo, hi)
        while at > lo:
            k = _token_at(enc, at - a)
            if k is not None and good(text, at):
                return k
            at = text.rfind(sep, lo, at)
    for rel in range(hi - a, 0, -1):  # no space or newline: any token boundary
        k = enc.char_to_token(rel)
        if k:
            return k
    return len(enc.ids)


def _space_cut(text: str, at: int) -> bool:
    return not text[at - 1].isspace() and not text[at + 1].isspace()


def _newline_cut(text: str, at: int) -> bool:
    return not text[at - 1].isspace()


def _token_at(enc, rel: int) -> int | None:
    """The index of the token that begins the text at ``rel`` (a space may belong to it though its offsets, trimmed,
    begin after it), or None when one token holds both the character before ``rel`` and the one at it."""
    j, n = enc.char_to_token(rel - 1), len(enc.ids)
    if j is None:
        return None
    while j + 1 < n and enc.token_to_chars(j + 1)[1] <= rel:  # the other byte tokens of that character
        j += 1
    if enc.token_to_chars(j)[1] > rel or j + 1 >= n or enc.token_to_chars(j + 1)[0] < rel:
        return None
    return j + 1


@dataclass
class DocCounts:
    documents: int = 0
    pieces: int = 0
    cut: int = 0

    def add(self, pieces: int) -> None:
        self.documents += 1
        self.pieces += pieces
        self.cut += pieces > 1


def document_pieces(tokenizer, rec: Record, seq_len: int, overlap: int, sink: DocSink | None, edges=None):
    """``(pieces as Examples, None)`` for a document up to ``WINDOW_CHARS``; ``(None, DocPieces)`` for a longer one,
    its pieces in ``sink``. Raises RecordProblem for a document with characters the tokenizer cannot represent.
    ``edges``: :func:`special_edges` of the tokenizer, when the caller has them (they are the same for every document)."""
    prefix, suffix = edges or special_edges(tokenizer)
    cutter, unk = Cutter(seq_len, overlap, skip=len(prefix)), tokenizer.unk_token_id
    long = len(rec.text) > WINDOW_CHARS and sink is not None
    if long:
        sink.open()
        chunks = window_tokens(tokenizer, rec.text)
    else:
        chunks = iter([tokenizer.backend_tokenizer.encode(rec.text, add_special_tokens=False).ids])
    done: list[tuple[np.ndarray, np.ndarray]] = []
    try:
        for ids in _ended(tokenizer, chunks, prefix, suffix, rec.text):
            if unk is not None and bool((ids == unk).any()):
                raise RecordProblem(UNREPRESENTABLE)
            done += cutter.feed(ids)
            if long and sum(len(i) for i, _ in done) >= SINK_TOKENS:
                sink.put(_examples(done))
                done = []
        done += cutter.finish()
    except RecordProblem:
        if long:
            sink.close().discard()
        raise
    if not long:
        return _examples(done), None
    sink.put(_examples(done))
    return None, sink.close()


def _examples(pieces: list[tuple[np.ndarray, np.ndarray]]) -> Examples:
    return Examples._join([i for i, _ in pieces], [lab for _, lab in pieces])


def _ended(tokenizer, chunks, prefix: list[int], suffix: list[int], text: str) -> Iterator[np.ndarray]:
    """The document's tokens: the tokenizer's prefix, the text's chunks, its suffix, and an EOS where it has none
    (as for every record: one the tokenizer added, or one the text wrote itself)."""
    yield np.asarray(prefix, dtype=np.int32)
    last: list[int] = prefix[-1:]
    for ids in chunks:
        if ids:
            last = ids[-1:]
            yield np.asarray(ids, dtype=np.int32)
    last = suffix[-1:] or last
    eos = tokenizer.eos_token_id
    needs = not (last == [eos] or text.rstrip().endswith(tokenizer.eos_token))
    yield np.asarray(suffix + ([eos] if needs else []), dtype=np.int32)


class Documents:
    """The pieces of a split's ``text`` records, in order: short ones inline (``flat``), each long one as a
    :class:`DocPieces` placed after the first ``n`` inline examples (``long``); unrepresentable ones as rejects."""

    def __init__(self, tokenizer, records: list[Record], seq_len: int, overlap: int, sink: DocSink | None):
        from ray_jobs.data.records import Reject
        from ray_jobs.data.sources import position_unit

        self.rejects: list[Reject] = []
        self.long: list[tuple[int, DocPieces]] = []
        self.counts = DocCounts()
        inline: list[Examples] = []
        edges = special_edges(tokenizer) if records else None  # once per batch, not two encodes per document
        for rec in records:
            try:
                ex, doc = document_pieces(tokenizer, rec, seq_len, overlap, sink, edges)
            except RecordProblem as e:
                self.rejects.append(Reject(rec.file, rec.line, str(e), rec.text[:200], position_unit(rec.file)))
                continue
            if doc is not None:
                self.long.append((sum(len(x.lengths) for x in inline), doc))
                self.counts.add(doc.pieces)
            else:
                inline.append(ex)
                self.counts.add(len(ex.lengths))
        self.flat = Examples.concat(inline)
