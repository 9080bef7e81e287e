"""Shapes other tools write (alpaca, sharegpt, TRL's prompt/completion) stage to exactly the bytes of their
hand-converted pairs/chat file, a wrong-shape record is a reject naming file:line and field, and ``format: auto``
names the shape from the first records (the dataset id holds it)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ray_jobs.data.shapes as shapes
from ray_jobs.config import DataConfig
from ray_jobs.data.records import parse_records
from ray_jobs.data.shapes import prefix_keys, resolve_format
from ray_jobs.data.sources import SourceFile
from ray_jobs.data.staging import StagingError, cached, stage
from ray_jobs.model.builtin import train_char_tokenizer

# [role] content, one line per message (the built-in tokenizer has no chat template of its own)
PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
# Stanford Alpaca's prompts, spelled out here so the test pins them
NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
    "### Response:\n"
)


@pytest.fixture(scope="module")
def toks(smollm2: Path) -> dict:
    from transformers import AutoTokenizer

    templated = train_char_tokenizer()
    templated.chat_template = PLAIN_TEMPLATE
    return {"smollm2": AutoTokenizer.from_pretrained(smollm2), "builtin": train_char_tokenizer(),
            "builtin-templated": templated}  # fmt: skip


def has_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def cfg(train: Path, **kw) -> DataConfig:
    return DataConfig(train=str(train), **{"seq_len": 512, "min_shards": 2, "eval_fraction": 0.25, **kw})


def shards(storage: Path, result) -> dict[str, list[str]]:
    """sha256 of every staged shard, by split, in order."""
    ds = storage / "datasets" / result.dataset_id
    return {split: [hashlib.sha256((ds / e.file).read_bytes()).hexdigest() for e in entries]
            for split, entries in result.manifest.shards.items()}  # fmt: skip


def alpaca(i: int) -> dict:
    rec = {"instruction": f"Add {i} and {i + 1}.", "output": f"{2 * i + 1}"}
    if i % 3 == 1:
        rec["input"] = f"Show it as a sum: {i}+{i + 1}"
    elif i % 3 == 2:
        rec["input"] = ""  # empty input: the no-input prompt
    if i % 4 == 0:
        rec["system"] = "You add numbers."
    return rec


def alpaca_by_hand(rec: dict, templated: bool) -> dict:
    question = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
    if templated:
        system = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        return {"messages": [*system, {"role": "user", "content": question},
                             {"role": "assistant", "content": rec["output"]}]}  # fmt: skip
    prompt = (WITH_INPUT if rec.get("input") else NO_INPUT).format(**rec)
    if rec.get("system"):  # a system prompt replaces the preamble
        prompt = rec["system"] + prompt[prompt.index("\n\n") :]
    return {"input": prompt, "target": rec["output"]}


def sharegpt(i: int) -> dict:
    turns = [{"from": "human", "value": f"{i}+1?"}, {"from": "gpt", "value": str(i + 1)}]
    if i % 2:
        turns += [{"from": "user", "value": "and times 2?"}, {"from": "assistant", "value": str(2 * i + 2)}]
    return {"conversations": ([{"from": "system", "value": "Be brief."}] if i % 3 == 0 else []) + turns}


ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_by_hand(rec: dict, templated: bool) -> dict:
    return {"messages": [{"role": ROLES.get(t["from"], t["from"]), "content": t["value"]}
                         for t in rec["conversations"]]}  # fmt: skip


def completion(i: int) -> dict:
    return {"prompt": f"Q: {i} squared?\nA:", "completion": f" {i * i}"}


def completion_by_hand(rec: dict, templated: bool) -> dict:
    return {"input": rec["prompt"], "target": rec["completion"]}


def conversational(i: int) -> dict:
    system = [{"role": "system", "content": "Answer with a number."}] if i % 2 else []
    return {"prompt": [*system, {"role": "user", "content": f"{i} squared?"}],
            "completion": [{"role": "assistant", "content": str(i * i)}]}  # fmt: skip


def conversational_by_hand(rec: dict, templated: bool) -> dict:
    return {"messages": rec["prompt"] + rec["completion"]}


SHAPES = {
    "alpaca": ("alpaca", alpaca, alpaca_by_hand),
    "sharegpt": ("sharegpt", sharegpt, sharegpt_by_hand),
    "prompt_completion": ("prompt_completion", completion, completion_by_hand),
    "prompt_completion-conversational": ("prompt_completion", conversational, conversational_by_hand),
}


@pytest.mark.parametrize("tok_name", ["smollm2", "builtin", "builtin-templated"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_a_shape_stages_the_bytes_of_its_hand_converted_file(tmp_path: Path, toks, tok_name: str, case: str) -> None:
    fmt, make, by_hand = SHAPES[case]
    tok, templated = toks[tok_name], has_template(toks[tok_name])
    records = [make(i) for i in range(40)]
    src = write_jsonl(tmp_path / "shape.jsonl", records)
    if fmt == "sharegpt" and not templated:
        with pytest.raises(StagingError, match=r"data.format=sharegpt needs a tokenizer with a chat template"):
            stage(cfg(src, format=fmt), tok, tok_name, str(tmp_path / "s"))
        return
    if case.endswith("conversational") and not templated:
        with pytest.raises(StagingError, match=r"shape\.jsonl:1: a conversational prompt/completion .* chat template"):
            stage(cfg(src, format=fmt), tok, tok_name, str(tmp_path / "s"))
        return
    converted = [by_hand(r, templated) for r in records]
    hand = write_jsonl(tmp_path / "hand.jsonl", converted)
    hand_fmt = "chat" if "messages" in converted[0] else "pairs"
    got = stage(cfg(src, format=fmt), tok, tok_name, str(tmp_path / "s"))
    want = stage(cfg(hand, format=hand_fmt), tok, tok_name, str(tmp_path / "s"))
    assert got.manifest.counts == want.manifest.counts and got.manifest.counts.rejects == 0
    assert got.manifest.counts.eval_examples > 0
    assert shards(tmp_path / "s", got) == shards(tmp_path / "s", want)
    assert got.manifest.format == fmt and got.dataset_id != want.dataset_id


BAD = {
    "alpaca": ({"conversations": [{"from": "human", "value": "hi"}]}, "missing field 'instruction' (data.format=alpaca)"),
    "alpaca-input": ({"instruction": "Say hi.", "input": 3, "output": "hi"}, "field 'input' must be a string, got int"),
    "sharegpt": ({"messages": [{"role": "user", "content": "hi"}]}, "missing field 'conversations' (data.format=sharegpt)"),
    "sharegpt-role": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]},
                      "conversations[1].from is 'bot'; expected one of human, user, gpt, assistant, system"),
    "sharegpt-last": ({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "yo"}]},
                      "the last message must be the assistant's (got 'user')"),
    "prompt_completion": ({"prompt": "1+1="}, "missing field 'completion' (data.format=prompt_completion)"),
    "prompt_completion-mixed": ({"prompt": [{"role": "user", "content": "1+1?"}], "completion": "2"},
                                "fields 'prompt' and 'completion' must both be strings or both lists of messages, "
                                "got list and str"),
    "prompt_completion-message": ({"prompt": [{"role": "user"}], "completion": [{"role": "assistant", "content": "2"}]},
                                  "prompt[0] must be an object with string 'role' and 'content'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_a_record_of_the_wrong_shape_is_rejected_naming_file_line_and_field(tmp_path: Path, toks, case: str) -> None:
    fmt = case.split("-")[0]
    bad, reason = BAD[case]
    _, make, _ = SHAPES[fmt]
    src = write_jsonl(tmp_path / "d.jsonl", [make(i) for i in range(20)] + [bad] + [make(99)])
    tok = toks["builtin-templated"]
    with pytest.raises(StagingError) as err:
        stage(cfg(src, format=fmt), tok, "t", str(tmp_path / "s"))
    assert f"{src}:21: {reason}" in str(err.value)
    r = stage(cfg(src, format=fmt, max_reject_fraction=0.1), tok, "t", str(tmp_path / "s"))
    rejects = [json.loads(x) for x in (tmp_path / "s" / "datasets" / r.dataset_id / "rejects.jsonl").open()]
    assert [(x["file"], x["line"], x["reason"]) for x in rejects] == [(str(src), 21, reason)]


def six_shapes(folder: Path) -> dict[str, Path]:
    """One small file per shape; sharegpt as Parquet (auto reads its schema)."""
    files = {
        "chat": write_jsonl(folder / "chat.jsonl", [sharegpt_by_hand(sharegpt(i), True) for i in range(30)]),
        "alpaca": write_jsonl(folder / "alpaca.jsonl", [alpaca(i) for i in range(30)]),
        "prompt_completion": write_jsonl(folder / "pc.jsonl", [conversational(i) for i in range(30)]),
        "pairs": write_jsonl(folder / "pairs.jsonl", [{"input": f"{i}+{i}=", "target": str(2 * i)} for i in range(30)]),
        "text": write_jsonl(folder / "text.jsonl", [{"text": f"document {i}: {'la ' * i}"} for i in range(30)]),
    }  # fmt: skip
    files["sharegpt"] = folder / "sharegpt.parquet"
    pq.write_table(pa.Table.from_pylist([sharegpt(i) for i in range(30)]), files["sharegpt"])
    for path in files.values():  # settled: staging indexes their hashes, so ``cached`` can find the dataset
        os.utime(path, (time.time() - 60, time.time() - 60))
    return files


def test_auto_detects_each_shape_and_the_dataset_id_holds_it(tmp_path: Path, toks, caplog) -> None:
    tok = toks["builtin-templated"]
    caplog.set_level(logging.INFO, logger="unbroken.staging")
    for fmt, src in six_shapes(tmp_path).items():
        auto = stage(cfg(src, format="auto"), tok, "t", str(tmp_path / "s"))
        assert auto.manifest.format == fmt
        named = stage(cfg(src, format=fmt), tok, "t", str(tmp_path / "s"))
        assert named.cache_hit and named.dataset_id == auto.dataset_id  # auto is the shape it found, not "auto"
        assert cached(cfg(src, format="auto"), tok, str(tmp_path / "s")).dataset_id == auto.dataset_id
        assert f"data.format=auto: detected {fmt} in {src}" in caplog.text
    # the same bytes read as another shape are another dataset, even where they stage the same tokens
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": f"{i}+{i}=", "completion": str(2 * i),
                                                  "input": f"{i}+{i}=", "target": str(2 * i)} for i in range(30)])  # fmt: skip
    auto = stage(cfg(both, format="auto"), tok, "t", str(tmp_path / "s"))
    pairs = stage(cfg(both, format="pairs"), tok, "t", str(tmp_path / "s"))
    assert auto.manifest.format == "prompt_completion" and auto.dataset_id != pairs.dataset_id
    assert shards(tmp_path / "s", auto) == shards(tmp_path / "s", pairs)


def test_auto_follows_the_configured_field_names(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}])
    data = resolve_format(cfg(src, format="auto", input_field="question", target_field="answer"))
    assert data.format == "pairs" and data.input_field == "question"
    dialog = write_jsonl(tmp_path / "c.jsonl", [{"dialog": [], "text": "x"}])
    assert resolve_format(cfg(dialog, format="auto", messages_field="dialog")).format == "chat"
    assert resolve_format(cfg(dialog, format="text")).format == "text"  # a named format is left alone


def test_auto_names_the_file_and_fields_it_cannot_place(tmp_path: Path, toks) -> None:
    src = write_jsonl(tmp_path / "odd.jsonl", [{"question": "1+1", "reply": "2"}] * 3)
    with pytest.raises(StagingError) as err:
        stage(cfg(src, format="auto"), toks["builtin"], "t", str(tmp_path / "s"))
    msg = str(err.value)
    assert f"cannot tell the shape of {src}" in msg and "(line 1): question, reply" in msg
    for expected in ("messages (chat)", "conversations (sharegpt)", "instruction+output (alpaca)",
                     "prompt+completion (prompt_completion)", "input+target (pairs)", "text (text)"):  # fmt: skip
        assert expected in msg


def test_auto_refuses_records_that_disagree_and_skips_lines_that_are_not_records(tmp_path: Path) -> None:
    lines = ["", "not json", json.dumps(alpaca(1)), json.dumps(alpaca(2)), json.dumps(sharegpt(3))]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(StagingError, match=r"disagree on their shape: line 3 is alpaca, line 5 is sharegpt"):
        resolve_format(cfg(src, format="auto"))
    src.write_text("\n".join(lines[:4] + [json.dumps(alpaca(i)) for i in range(10)] + [json.dumps(sharegpt(3))]))
    assert resolve_format(cfg(src, format="auto")).format == "alpaca"  # five records sampled, the sixth not read


class SpyFS:
    """A file system that counts the bytes read through it and refuses to open a file for streaming."""

    def __init__(self, fs):
        self.fs, self.read = fs, 0

    def cat_file(self, path, start=None, end=None):
        data = self.fs.cat_file(path, start=start, end=end)
        self.read += len(data)
        return data

    def open(self, *a, **kw):
        raise AssertionError("detection must not stream a JSONL file")


def test_auto_detects_a_first_line_longer_than_it_reads(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "long.jsonl"
    first = {
        "system": 'a "quoted" {brace}, [bracket]',
        "instruction": "Repeat.",
        "output": "z" * 3_000_000,
        "input": "",
    }
    src.write_text(json.dumps(first) + "\n" + json.dumps(alpaca(1)) + "\n")
    spies = []

    def spied(url):
        fs, path = real(url)
        spies.append(SpyFS(fs))
        return spies[-1], path

    real = shapes.fs_and_path
    monkeypatch.setattr(shapes, "fs_and_path", spied)
    assert resolve_format(cfg(src, format="auto")).format == "alpaca"
    assert sum(s.read for s in spies) <= shapes.SNIFF_BYTES


def test_prefix_keys_reads_top_level_keys_of_a_cut_object() -> None:
    text = json.dumps({"a": {"b": 1, "c": [1, {"d": "}"}]}, 'e"x': 's, "t" ]', "f": None, "g": "long value"})
    assert prefix_keys(text) == ["a", 'e"x', "f", "g"]
    assert prefix_keys(text[: text.index("long")]) == ["a", 'e"x', "f", "g"]
    assert prefix_keys(text[: text.index('"g"') + 1]) == ["a", 'e"x', "f"]  # cut inside a key
    assert prefix_keys('  {"k\\u00e9": 1') == ["k\u00e9"]
    assert prefix_keys("[1, 2]") is None and prefix_keys("{") == []


def test_max_record_chars_defaults_to_100k_for_prompts_and_no_limit_for_text() -> None:
    def parsed(obj: dict, **kw):
        src = SourceFile("m.jsonl", json.dumps(obj).encode() + b"\n")
        return parse_records(src, DataConfig(train="m.jsonl", **kw))

    long = "x" * 100_001
    records, rejects = parsed({"input": long[2:], "target": "y"})
    assert records and not rejects
    records, rejects = parsed({"input": long, "target": "y"})
    assert rejects[0].reason == "record is 100002 characters, over data.max_record_chars (100000)"
    records, rejects = parsed({"text": long * 2}, format="text")
    assert records and not rejects
    records, rejects = parsed({"text": long}, format="text", max_record_chars=50)
    assert rejects[0].reason == "record is 100001 characters, over data.max_record_chars (50)"


def test_samples_read_the_staged_eval_split_of_a_detected_shape_token_for_token(tmp_path: Path, smollm2: Path) -> None:
    """The samples' prompts are the staged eval rows' (the chat template as staging applied it), never the raw
    sources read again: on a remote cluster those may be a path of the flow's host only."""
    from ray_jobs.data.cache import ShardCache
    from ray_jobs.data.reading import open_rows
    from ray_jobs.model.loading import load_tokenizer
    from ray_jobs.train.samples import staged_examples

    src = write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(40)])
    data = DataConfig(train=str(src), format="auto", eval_fraction=0.5, seq_len=256, work_dir=str(tmp_path / "w"))
    tok = load_tokenizer(str(smollm2))
    staged = stage(data, tok, str(smollm2), str(tmp_path / "s"))
    cache = ShardCache(str(tmp_path / "s"), staged.dataset_id, str(tmp_path / "cache"), 1e9)
    src.unlink()  # the raw source is gone (it is another host's): the samples need only what was staged
    rows = open_rows(cache, staged.manifest.shards["eval"], staged.manifest.seq_len)
    examples = staged_examples(rows, False, 3)
    assert len(examples) == 3
    for prompt, target in examples:
        text = tok.decode(prompt)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"), text
        assert tok.decode(target, skip_special_tokens=True).isdigit()
