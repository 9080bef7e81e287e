"""Long ``text`` documents: cut into pieces of at most ``seq_len`` tokens, every token learned once, none mixed.

Asserted from the staged shards themselves, against each document's tokens as the tokenizer gives them for the
whole text, with the built-in character tokenizer and SmolLM2's byte-level BPE.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import ray_jobs.data.documents as documents
from ray_jobs.config import DataConfig
from ray_jobs.data.staging import stage
from ray_jobs.data.tokenize import IGNORE_INDEX
from ray_jobs.model.builtin import train_char_tokenizer

WORDS = ["The", "manual", "says", "don't", "restart", "über", "naïve", "日本語", "123456", "3.14", ",", ".", "  ",
         "\n", "\n\n", "\t", "we'll", "emoji😀", "x" * 40, "</s>", "pump", "valve", "pressure", "(see §4.2)"]  # fmt: skip


def corpus_text(rng: random.Random, chars: int, ascii_only: bool = False) -> str:
    """Manual-like text with the boundaries a cut must survive: runs of spaces, newlines, digits, accents, emoji
    (``ascii_only``: what the built-in tokenizer can represent)."""
    words = [w for w in WORDS if w.isascii()] if ascii_only else WORDS
    out, n = [], 0
    while n < chars:
        w = rng.choice(words) + (" " if rng.random() < 0.75 else "")
        out.append(w)
        n += len(w)
    return "".join(out)[:chars].strip() or "x"


def doc_tokens(tok, text: str) -> list[int]:
    """A document's tokens as a whole-text encoding gives them, with the EOS that ends every example."""
    ids = tok(text)["input_ids"]
    return ids if ids[-1:] == [tok.eos_token_id] or text.rstrip().endswith(tok.eos_token) else [*ids, tok.eos_token_id]


def staged_examples(manifest_url: str, split: str) -> list[tuple[list[int], list[int], list[int]]]:
    """Every example of a split, in order: rows cut where positions restart; padding (nothing learned) left out."""
    manifest = json.loads(Path(manifest_url).read_text())
    out = []
    for shard in manifest["shards"][split]:
        cols = pq.read_table(Path(manifest_url).parent / shard["file"]).to_pydict()
        for ids, labels, pos in zip(cols["input_ids"], cols["labels"], cols["position_ids"], strict=True):
            starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                if any(lab != IGNORE_INDEX for lab in labels[a:b]):
                    out.append((ids[a:b], labels[a:b], pos[a:b]))
    return out


def check_pieces(tok, texts: list[str], examples, seq_len: int, overlap: int) -> int:
    """Each document's pieces, in order: contiguous runs of its tokens, at most ``seq_len`` long, with positions
    from 0, overlapping by the context; their learned tokens are the document's tokens but the first. Returns the
    number of pieces."""
    it = iter(examples)
    context = max(1, overlap)
    for text in texts:
        tokens = doc_tokens(tok, text)
        learned, at, n = [], 0, 0
        while at < len(tokens):
            ids, labels, pos = next(it)
            start = 0 if n == 0 else at - context
            assert len(ids) <= seq_len and ids == tokens[start : start + len(ids)], "a piece is a run of one doc"
            assert pos == list(range(len(ids))), "a piece attends only to itself"
            learned += [lab for lab in labels if lab != IGNORE_INDEX]
            at, n = start + len(ids), n + 1
        assert learned == tokens[1:], "every token but the first is learned exactly once"
    assert next(it, None) is None, "no piece from anywhere else"
    return len(examples)


@pytest.fixture(scope="module")
def smol_tok(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def _stage_docs(tmp: Path, tok, texts: list[str], seq_len: int, overlap: int = 0):
    src, ev = tmp / "docs.jsonl", tmp / "eval.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ev.write_text(json.dumps({"text": "a held-out page"}) + "\n")
    data = DataConfig(train=str(src), eval=str(ev), format="text", seq_len=seq_len, text_overlap_tokens=overlap,
                      min_shards=2, work_dir=str(tmp / "work"))  # fmt: skip
    return stage(data, tok, "tok", str(tmp / "storage"))


@pytest.mark.parametrize("which", ["builtin", "smollm2"])
def test_documents_from_10_to_200k_tokens_stage_with_every_token_learned_once(tmp_path, which, request) -> None:
    tok = train_char_tokenizer() if which == "builtin" else request.getfixturevalue("smol_tok")
    rng = random.Random(3)
    chars_per_token = 1.2 if which == "builtin" else 2.4
    sizes = [10, 200, 511, 512, 513, 3000, 40_000, 230_000]  # tokens, about
    texts = [corpus_text(rng, int(n * chars_per_token), which == "builtin") for n in sizes]
    assert len(doc_tokens(tok, texts[-1])) >= 200_000 and len(texts[-1]) > documents.WINDOW_CHARS
    overlap = 0 if which == "builtin" else 32
    result = _stage_docs(tmp_path, tok, texts, seq_len=512, overlap=overlap)
    counts = result.manifest.counts.model_dump()
    assert counts["rejects"] == 0 and counts["documents"] == len(texts) + 1
    pieces = check_pieces(tok, texts, staged_examples(result.manifest_url, "train"), 512, overlap)
    cut = sum(len(doc_tokens(tok, t)) > 512 for t in texts)
    assert counts["pieces"] == pieces + 1 and counts["cut_documents"] == cut >= 4
    assert not list((tmp_path / "work").rglob("doc-*.npy")), "long documents' pieces are read and removed"


@pytest.mark.parametrize("which", ["builtin", "smollm2"])
def test_a_document_encoded_in_windows_has_its_whole_text_tokens(which, request, monkeypatch) -> None:
    """Small windows: hundreds of cuts, each at a different kind of boundary, against one whole-text encoding."""
    tok = train_char_tokenizer() if which == "builtin" else request.getfixturevalue("smol_tok")
    monkeypatch.setattr(documents, "WINDOW_CHARS", 3000)
    monkeypatch.setattr(documents, "BACKOFF_CHARS", 400)
    monkeypatch.setattr(documents, "CHECK_CHARS", 200)
    text = corpus_text(random.Random(5), 400_000, which == "builtin")
    got = np.concatenate([np.asarray(c, dtype=np.int64) for c in documents.window_tokens(tok, text)])
    assert got.tolist() == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_a_long_document_leaves_the_worker_in_chunks_not_as_one_token_list(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(documents, "WINDOW_CHARS", 20_000)
    monkeypatch.setattr(documents, "SINK_TOKENS", 10_000)
    tok, text = train_char_tokenizer(), corpus_text(random.Random(1), 300_000, ascii_only=True)
    rec = documents.Record("d.jsonl", 1, "", text, text, [(0, len(text))])
    inline, doc = documents.document_pieces(tok, rec, 256, 0, documents.DocSink(str(tmp_path)))
    assert inline is None and doc.chunks >= 20 and doc.tokens < 2 * len(text)
    chunks = list(doc.read())
    assert max(len(c.ids) for c in chunks) < 31_000, "a chunk is about a window's tokens, never the document's"
    learned = np.concatenate([c.labels[c.labels != IGNORE_INDEX] for c in chunks])
    assert learned.tolist() == doc_tokens(tok, text)[1:]
    doc.discard()
    assert not list(tmp_path.iterdir())


def test_overlap_is_context_not_learned_and_is_checked_against_seq_len() -> None:
    cutter = documents.Cutter(seq_len=8, overlap=3)
    pieces = cutter.feed(np.arange(20, dtype=np.int32)) + cutter.finish()
    assert [p[0].tolist() for p in pieces] == [list(range(8)), list(range(5, 13)), list(range(10, 18)),
                                               list(range(15, 20))]  # fmt: skip
    assert [int((p[1] != IGNORE_INDEX).sum()) for p in pieces] == [8, 5, 5, 2]
    with pytest.raises(ValueError, match="text_overlap_tokens"):
        DataConfig(train="x", format="text", seq_len=16, text_overlap_tokens=9)
