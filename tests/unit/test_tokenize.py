"""Tokenizing: staged ids are what the tokenizer gives at inference, and exactly the replies are learned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_jobs.config import DataConfig
from ray_jobs.data.records import parse_records
from ray_jobs.data.sources import SourceFile
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.data.tokenize import IGNORE_INDEX, Tokenized, chat_renderer, learned_mask, tokenizer_fingerprint
from ray_jobs.model.builtin import train_char_tokenizer

# [role] content, one line per message; no end-of-turn marker, so staging appends EOS
PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
# like templates that hide earlier replies (reasoning models): a turn renders differently once others follow
HIDING_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] "
    "{% if m['role'] == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m['content'] }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and 4+4?"},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture(scope="module")
def smol_tok(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def char_tok(template: str | None = None):
    tok = train_char_tokenizer()
    tok.chat_template = template
    return tok


def tokenized(tok, objs: list[dict], **cfg) -> tuple[Tokenized, list]:
    """Records of ``objs`` (as lines of one JSONL file) validated and tokenized as staging does."""
    data = DataConfig(train="mem.jsonl", **cfg)
    src = SourceFile("mem.jsonl", b"".join(json.dumps(o).encode() + b"\n" for o in objs))
    render = chat_renderer(tok, "t", data.train_on) if data.format == "chat" else None
    records, rejects = parse_records(src, data, render=render)
    out = Tokenized(tok, records, data.seq_len)
    return out, rejects + out.rejects


def learned(ids: list[int], labels: list[int]) -> list[int]:
    return [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]


PAIRS = [
    ("What is 2+3? Answer:", " 5"),
    ("Translate 'chat' to English:\n", "cat"),
    ("<|im_start|>user\n7*6<|im_end|>\n<|im_start|>assistant\n", "42<|im_end|>"),
]


def test_pairs_ids_are_the_tokenizers_ids_of_prompt_plus_target(smol_tok) -> None:
    t, rejects = tokenized(smol_tok, [{"input": p, "target": c} for p, c in PAIRS])
    assert not rejects
    eos = smol_tok.eos_token_id
    for (prompt, target), (ids, labels) in zip(PAIRS, t.examples, strict=True):
        whole = smol_tok(prompt + target)["input_ids"]
        if target.endswith(smol_tok.eos_token):  # already ends with EOS: none is added, it is learned
            assert ids == whole and labels[-1] == eos
        else:
            assert ids == whole + [eos] and labels[-1] == eos
        assert smol_tok.decode(learned(ids, labels)).removesuffix(smol_tok.eos_token) == target.removesuffix(
            smol_tok.eos_token
        )


def test_a_token_straddling_the_prompt_boundary_is_learned(smol_tok) -> None:
    (ids, labels), *_ = tokenized(smol_tok, [{"input": "2+3=hel", "target": "lo"}])[0].examples
    assert ids[:-1] == smol_tok("2+3=hello")["input_ids"]
    assert smol_tok.decode(learned(ids, labels)[:-1]).endswith("lo")


def test_builtin_pairs_get_bos_from_the_tokenizer_and_the_same_ids_as_before() -> None:
    tok = char_tok()
    (ids, labels), *_ = tokenized(tok, [{"input": "12+3=", "target": "15"}])[0].examples
    chars = tok("12+3=15", add_special_tokens=False)["input_ids"]
    assert ids == [tok.bos_token_id] + chars + [tok.eos_token_id] == tok("12+3=15")["input_ids"] + [tok.eos_token_id]
    assert labels == [IGNORE_INDEX] * 6 + chars[5:] + [tok.eos_token_id]


def test_text_learns_all_but_the_tokenizers_own_bos() -> None:
    tok = char_tok()
    (ids, labels), *_ = tokenized(tok, [{"text": "abc"}], format="text")[0].examples
    assert labels == [IGNORE_INDEX] + ids[1:] and ids[0] == tok.bos_token_id


def test_chat_ids_match_apply_chat_template_and_every_reply_is_learned(smol_tok) -> None:
    t, rejects = tokenized(smol_tok, [{"messages": CONVERSATION}], format="chat")
    (ids, labels), *_ = t.examples
    assert not rejects
    assert ids == smol_tok.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"], "no EOS added to ChatML"
    assert smol_tok.decode(learned(ids, labels)) == "5<|im_end|>8<|im_end|>"
    assert smol_tok.decode(ids[-1:]) == "\n" and labels[-1] == IGNORE_INDEX, "the newline after a turn is not learned"


def test_chat_last_assistant_learns_only_the_final_reply(smol_tok) -> None:
    t, _ = tokenized(smol_tok, [{"messages": CONVERSATION}], format="chat", train_on="last_assistant")
    (ids, labels), *_ = t.examples
    assert smol_tok.decode(learned(ids, labels)) == "8<|im_end|>"


def test_chat_record_keeps_the_rendered_prompt_and_the_final_reply(smol_tok) -> None:
    data = DataConfig(train="mem.jsonl", format="chat")
    src = SourceFile("mem.jsonl", json.dumps({"messages": CONVERSATION}).encode())
    (rec,), _ = parse_records(src, data, render=chat_renderer(smol_tok, "t"))
    assert rec.prompt == smol_tok.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert (rec.target, rec.shown) == ("8", "and 4+4?")


def test_chat_without_an_end_marker_gets_an_eos_that_ends_the_reply() -> None:
    tok = char_tok(PLAIN_TEMPLATE)
    (ids, labels), *_ = tokenized(tok, [{"messages": CONVERSATION}], format="chat")[0].examples
    assert ids[-1] == tok.eos_token_id and ids[0] != tok.bos_token_id, "the template's text only, plus EOS"
    assert tok.decode(learned(ids, labels)) == "58\n</s>"


def test_a_template_that_rewrites_earlier_turns_is_rejected_unless_only_the_last_is_learned() -> None:
    tok = char_tok(HIDING_TEMPLATE)
    t, rejects = tokenized(tok, [{"messages": CONVERSATION}], format="chat")
    assert not t.examples and "messages[1]" in rejects[0].reason and "data.train_on=last_assistant" in rejects[0].reason
    t, rejects = tokenized(tok, [{"messages": CONVERSATION}], format="chat", train_on="last_assistant")
    assert not rejects and tok.decode(learned(*t.examples[0])) == "8</s>"


def test_an_opening_assistant_message_is_context_and_a_lone_reply_is_rejected() -> None:
    tok = char_tok(PLAIN_TEMPLATE)
    opening = [{"role": "assistant", "content": "Hi!"}, *CONVERSATION]
    t, rejects = tokenized(tok, [{"messages": opening}, {"messages": CONVERSATION[1:2]}], format="chat")
    assert tok.decode(learned(*t.examples[0])) == "58\n</s>"
    assert [r.reason for r in rejects] == ["a conversation needs a message before the assistant's reply"]


def test_a_failing_chat_template_rejects_the_record_naming_file_and_line(tmp_path: Path) -> None:
    tok = char_tok(
        "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('no boom allowed') }}{% endif %}" + PLAIN_TEMPLATE
    )
    lines = [
        {"messages": [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": str(i)}]}
        for i in range(30)
    ]
    lines.insert(7, {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]})
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(StagingError, match=r"c\.jsonl:8: chat template failed: no boom allowed"):
        stage(DataConfig(train=str(src), format="chat", seq_len=64, min_shards=1), tok, "t", str(tmp_path / "s"))


def test_editing_the_chat_template_changes_the_dataset_id(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(30)))
    cfg = DataConfig(train=str(src), format="chat", seq_len=64, min_shards=1, eval_fraction=0.0, eval=str(src))
    a, b = char_tok(PLAIN_TEMPLATE), char_tok("# " + PLAIN_TEMPLATE)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(char_tok({"default": PLAIN_TEMPLATE}))
    ids = [stage(cfg, tok, "t", str(tmp_path / "s")).dataset_id for tok in (a, b)]
    assert ids[0] != ids[1]
    assert (
        stage(cfg.model_copy(update={"train_on": "last_assistant"}), a, "t", str(tmp_path / "s")).dataset_id != ids[0]
    )


def test_learned_mask_follows_offsets_and_special_tokens_follow_their_neighbour() -> None:
    offsets = [(0, 0), (0, 3), (3, 5), (5, 6), (6, 6), (6, 8)]
    assert learned_mask(offsets, [(4, 6)]) == [False, False, True, True, True, False]
    assert learned_mask(offsets, []) == [False] * 6


def test_the_staged_real_chat_set_has_one_end_marker_per_reply_and_learns_every_reply(smol_tok, tmp_path) -> None:
    """The recipe's data (configs/data/chat_json.jsonl) staged with SmolLM2's ChatML template, read back from the
    Parquet shards: no reply ends in a doubled <|im_end|>, and every assistant turn (not only the last) is learned."""
    import numpy as np
    import pyarrow.parquet as pq

    from tests.conftest import ROOT

    source = ROOT / "configs" / "data" / "chat_json.jsonl"
    data = DataConfig(train=str(source), format="chat", seq_len=256, min_shards=1)
    result = stage(data, smol_tok, "smollm2", str(tmp_path / "storage"))
    assert result.manifest.counts.rejects == 0
    replies = [m["content"] for line in source.read_text().splitlines() for m in json.loads(line)["messages"]
               if m["role"] == "assistant"]  # fmt: skip
    learned_replies, end = [], smol_tok.convert_tokens_to_ids("<|im_end|>")
    shards = Path(result.manifest_url).parent.glob("*.parquet")
    for table in (pq.read_table(f) for f in shards):
        columns = (table.column(c).to_pylist() for c in ("input_ids", "labels", "position_ids"))
        for ids, labels, pos in zip(*columns, strict=True):
            starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
            for a, b in zip(starts[:-1], starts[1:], strict=True):  # one packed example (or the padding run) at a time
                if all(x == IGNORE_INDEX for x in labels[a:b]):
                    continue  # the padding run
                text = smol_tok.decode(ids[a:b])
                assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n"), text
                assert "<|im_end|><|im_end|>" not in text and "<|im_end|>\n<|im_end|>" not in text, text
                lab = np.array(labels[a:b])
                # learned runs: each is one reply followed by its single end marker
                runs = np.split(lab, np.where(lab == IGNORE_INDEX)[0])
                for run in (r[r != IGNORE_INDEX] for r in runs):
                    if len(run):
                        assert run[-1] == end and end not in run[:-1]
                        learned_replies.append(smol_tok.decode(run[:-1]))
    assert sorted(learned_replies) == sorted(replies), "every assistant turn of every conversation is learned once"
