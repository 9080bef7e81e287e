"""``data.too_long``: an over-long chat or prompt/completion record is rejected, dropped or truncated -- counted,
listed, and never staged with nothing learned. SmolLM2's real ChatML template and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_jobs.config import DataConfig
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.data.tokenize import IGNORE_INDEX
from tests.unit.test_documents import staged_examples

SEQ = 96
WORDS = " ".join(f"step{i}" for i in range(200))  # ~400 tokens


def ex(user: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


CHATS = [
    ex("hi", "hello"),  # fits
    ex("long ago", WORDS) + ex("and now?", "now is short"),  # fits once its first exchange is dropped
    [{"role": "system", "content": "Be brief."}, *ex("list the steps", WORDS)],  # its one reply is cut
    ex(WORDS, "ok"),  # its prompt alone is too long: cannot be truncated
]
PAIRS = [("2+2=", "4"), ("Steps: ", WORDS), (WORDS, "done")]


@pytest.fixture(scope="module")
def smol_tok(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def _stage(tmp: Path, tok, fmt: str, too_long: str, **extra):
    src, ev = tmp / f"{fmt}.jsonl", tmp / "eval.jsonl"
    if fmt == "chat":
        src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
        ev.write_text(json.dumps({"messages": ex("q", "a")}) + "\n")
    else:
        src.write_text("".join(json.dumps({"input": p, "target": t}) + "\n" for p, t in PAIRS))
        ev.write_text(json.dumps({"input": "q", "target": "a"}) + "\n")
    data = DataConfig(train=str(src), eval=str(ev), format=fmt, seq_len=SEQ, too_long=too_long, min_shards=1,
                      work_dir=str(tmp / "w"), **extra)  # fmt: skip
    result = stage(data, tok, "smol", str(tmp / f"s-{too_long}"))
    rejects = [json.loads(x) for x in (Path(result.manifest_url).parent / "rejects.jsonl").read_text().splitlines()]
    return result.manifest.counts.model_dump(), rejects, staged_examples(result.manifest_url, "train")


def _learned(examples) -> list[list[int]]:
    return [[lab for lab in labels if lab != IGNORE_INDEX] for _, labels, _ in examples]


@pytest.mark.parametrize("fmt", ["chat", "pairs"])
def test_reject_counts_against_the_limit_and_drop_does_not(tmp_path, smol_tok, fmt) -> None:
    long = 3 if fmt == "chat" else 2
    with pytest.raises(StagingError, match=rf"{long} of {len(CHATS if fmt == 'chat' else PAIRS) + 1} records rejected"):
        _stage(tmp_path, smol_tok, fmt, "reject")
    counts, rejects, examples = _stage(tmp_path, smol_tok, fmt, "reject", max_reject_fraction=1.0)
    assert (counts["rejects"], counts["dropped"]) == (long, 0)
    assert all("longer than data.seq_len" in r["reason"] and "dropped" not in r for r in rejects)
    counts, rejects, examples = _stage(tmp_path, smol_tok, fmt, "drop")
    assert (counts["rejects"], counts["dropped"], counts["truncated"]) == (0, long, 0)
    assert [r["line"] for r in rejects] == ([2, 3, 4] if fmt == "chat" else [2, 3])
    assert all(r["dropped"] and "dropped (data.too_long=drop)" in r["reason"] for r in rejects)
    assert len(examples) == 1 and all(_learned(examples))


def test_truncate_drops_earlier_exchanges_then_cuts_the_reply_keeping_its_end_marker(tmp_path, smol_tok) -> None:
    counts, rejects, examples = _stage(tmp_path, smol_tok, "chat", "truncate")
    assert (counts["truncated"], counts["dropped"], counts["rejects"]) == (2, 1, 0)
    (unfit,) = rejects
    assert unfit["line"] == 4 and unfit["dropped"] and "no room for one token of the reply" in unfit["reason"]
    assert len(examples) == 3 and all(len(ids) <= SEQ for ids, _, _ in examples)
    end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    for learned in _learned(examples):
        assert len(learned) >= 2 and learned[-1] == end, "some of the reply, then its end-of-turn marker, learned"
    second = smol_tok.decode([i for i in examples[1][0]])
    assert "long ago" not in second and "now is short<|im_end|>" in second, "the first exchange went, not the last"
    third = smol_tok.decode(examples[2][0])
    assert "Be brief." in third and "step0 step1" in third and "step199" not in third, "the reply cut from its end"


def test_truncate_cuts_a_pairs_target_from_its_end_and_keeps_eos(tmp_path, smol_tok) -> None:
    counts, rejects, examples = _stage(tmp_path, smol_tok, "pairs", "truncate")
    assert (counts["truncated"], counts["dropped"]) == (1, 1) and rejects[0]["line"] == 3
    ids, labels, _ = examples[1]
    assert len(ids) == SEQ or len(ids) == SEQ - 1, "cut to the longest prefix that fits"
    learned = _learned(examples)[1]
    assert learned[-1] == smol_tok.eos_token_id and smol_tok.decode(learned).strip().startswith("step0 step1")
