"""Staging: every record validated (bad ones named file:line, never dropped), content-addressed, packed right."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ray_jobs.config import DataConfig
from ray_jobs.data.staging import IGNORE_INDEX, StagingError, pack, stage
from ray_jobs.model.builtin import train_char_tokenizer
from tests.conftest import SAMPLE_DATA


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer()


def data_cfg(train: Path, **kw) -> DataConfig:
    return DataConfig(train=str(train), seq_len=kw.pop("seq_len", 64), min_shards=kw.pop("min_shards", 2), **kw)


def write_jsonl(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def good(i: int) -> str:
    return json.dumps({"input": f"{i}+{i}=", "target": str(2 * i)})


def test_stage_writes_shards_and_manifest(tmp_path: Path, tokenizer) -> None:
    r = stage(data_cfg(SAMPLE_DATA, shard_mb=0.05), tokenizer, "builtin", str(tmp_path))
    assert not r.cache_hit and r.dataset_id.startswith("ds-")
    m = r.manifest
    assert m.counts.records == 6000 and m.counts.rejects == 0
    assert m.counts.train_examples + m.counts.eval_examples == 6000
    ds = tmp_path / "datasets" / r.dataset_id
    assert json.loads((ds / "manifest.json").read_text()) == m.dump()
    for split in ("train", "eval"):
        rows = 0
        for e in m.shards[split]:
            table = pq.read_table(ds / e.file)
            assert table.num_rows == e.rows
            assert all(len(x) == 64 for x in table.column("input_ids").to_pylist())
            rows += e.rows
        assert rows == getattr(m.counts, f"{split}_rows")
    assert len(m.shards["train"]) >= 2


def test_restaging_is_a_cache_hit_that_writes_nothing(tmp_path: Path, tokenizer) -> None:
    cfg = data_cfg(SAMPLE_DATA)
    first = stage(cfg, tokenizer, "builtin", str(tmp_path))
    ds = tmp_path / "datasets" / first.dataset_id
    before = {p: p.stat().st_mtime_ns for p in ds.iterdir()}
    again = stage(cfg, tokenizer, "builtin", str(tmp_path))
    assert again.cache_hit and again.dataset_id == first.dataset_id
    assert {p: p.stat().st_mtime_ns for p in ds.iterdir()} == before


def test_same_inputs_stage_to_the_same_id_and_bytes(tmp_path: Path, tokenizer) -> None:
    a, b = (stage(data_cfg(SAMPLE_DATA), tokenizer, "builtin", str(tmp_path / s)) for s in ("a", "b"))
    assert a.dataset_id == b.dataset_id and not b.cache_hit
    files = sorted(p.name for p in (tmp_path / "a" / "datasets" / a.dataset_id).iterdir())
    for name in files:
        assert (tmp_path / "a" / "datasets" / a.dataset_id / name).read_bytes() == (
            tmp_path / "b" / "datasets" / b.dataset_id / name
        ).read_bytes(), name


def test_changing_one_record_changes_the_id(tmp_path: Path, tokenizer) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [good(i) for i in range(200)])
    id1 = stage(data_cfg(a), tokenizer, "builtin", str(tmp_path / "s")).dataset_id
    write_jsonl(a, [good(i) for i in range(199)] + [good(1000)])
    id2 = stage(data_cfg(a), tokenizer, "builtin", str(tmp_path / "s")).dataset_id
    assert id1 != id2


BAD_LINES = {
    "invalid JSON": '{"input": "1+1=", "target": ',
    "invalid UTF-8": b'{"input": "1+1=", "target": "\xff"}',
    "missing field 'target'": '{"input": "1+1="}',
    "field 'target' must be a string, got int": '{"input": "1+1=", "target": 2}',
    "field 'input' is empty": '{"input": "  ", "target": "2"}',
    "over data.max_record_chars": json.dumps({"input": "1" * 500, "target": "2"}),
    "expected a JSON object": "[1, 2]",
}


@pytest.mark.parametrize("reason", list(BAD_LINES))
def test_each_bad_record_fails_staging_naming_file_and_line(tmp_path: Path, tokenizer, reason: str) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(40)] + [BAD_LINES[reason]] + [good(99)])
    with pytest.raises(StagingError) as err:
        stage(data_cfg(src, max_record_chars=300), tokenizer, "builtin", str(tmp_path / "s"))
    assert f"{src}:41: " in str(err.value) and reason in str(err.value)


def test_rejects_within_the_allowed_fraction_are_quarantined_not_dropped(tmp_path: Path, tokenizer) -> None:
    lines = [good(i) for i in range(100)]
    bad_at = {}
    for n, line in enumerate(BAD_LINES.values()):
        lines.insert(10 * n + 3, line)
    for i, line in enumerate(lines, start=1):
        if line in BAD_LINES.values():
            bad_at[i] = line
    src = write_jsonl(tmp_path / "d.jsonl", lines)
    r = stage(data_cfg(src, max_record_chars=300, max_reject_fraction=0.1), tokenizer, "builtin", str(tmp_path / "s"))
    rejects = [
        json.loads(x) for x in (tmp_path / "s" / "datasets" / r.dataset_id / "rejects.jsonl").read_text().splitlines()
    ]
    assert sorted(x["line"] for x in rejects) == sorted(bad_at)
    assert all(x["file"] == str(src) and x["reason"] for x in rejects)
    assert r.manifest.counts.rejects == len(BAD_LINES)
    assert r.manifest.counts.train_examples + r.manifest.counts.eval_examples == 100


def test_characters_the_tokenizer_cannot_represent_are_rejected(tmp_path: Path, tokenizer) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(20)] + [json.dumps({"input": "é=", "target": "1"})])
    with pytest.raises(StagingError, match=r"d\.jsonl:21: contains characters the tokenizer cannot represent"):
        stage(data_cfg(src), tokenizer, "builtin", str(tmp_path / "s"))


def test_empty_and_missing_inputs_are_clear_errors(tmp_path: Path, tokenizer) -> None:
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(StagingError, match=r"no records found in .*empty\.jsonl"):
        stage(data_cfg(empty), tokenizer, "builtin", str(tmp_path / "s"))
    with pytest.raises(StagingError, match=r"data\.train: no such file or folder: .*nope\.jsonl"):
        stage(data_cfg(tmp_path / "nope.jsonl"), tokenizer, "builtin", str(tmp_path / "s"))
    os.mkdir(tmp_path / "dir")
    with pytest.raises(StagingError, match=r"data\.train: folder .*dir has no"):
        stage(data_cfg(tmp_path / "dir"), tokenizer, "builtin", str(tmp_path / "s"))


def test_prompt_tokens_are_masked_and_examples_never_straddle_rows(tmp_path: Path, tokenizer) -> None:
    rows = pack([([1, 5, 6, 7, 2], [IGNORE_INDEX, IGNORE_INDEX, 6, 7, 2])] * 3, seq_len=8, pad_id=0)
    assert rows.ids == [[1, 5, 6, 7, 2, 0, 0, 0]] * 3
    assert rows.labels[0] == [IGNORE_INDEX, IGNORE_INDEX, 6, 7, 2] + [IGNORE_INDEX] * 3
    assert rows.positions[0] == [0, 1, 2, 3, 4, 0, 1, 2]
    src = write_jsonl(
        tmp_path / "d.jsonl", [json.dumps({"input": f"12+{i}=", "target": str(12 + i)}) for i in range(40)]
    )
    r = stage(data_cfg(src, eval_fraction=0.3, min_shards=1), tokenizer, "builtin", str(tmp_path / "s"))
    row = pq.read_table(tmp_path / "s" / "datasets" / r.dataset_id / "train-00000.parquet").to_pylist()[0]
    text = tokenizer.decode(row["input_ids"])
    learned = tokenizer.decode(
        [i for i, lab in zip(row["input_ids"], row["labels"], strict=True) if lab != IGNORE_INDEX]
    )
    assert text.startswith("<s>12+") and "=" in text
    assert "+" not in learned and "=" not in learned, "prompt tokens must be masked from the loss"
    assert learned.count("</s>") == text.count("</s>"), "every example in the row is whole (ends with its EOS)"


def test_empty_eval_split_is_an_error(tmp_path: Path, tokenizer) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(30)])
    with pytest.raises(StagingError, match="eval split is empty"):
        stage(data_cfg(src, eval_fraction=0.0), tokenizer, "builtin", str(tmp_path / "s"))


def test_text_format_learns_every_token_of_the_text(tmp_path: Path, tokenizer) -> None:
    src = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"text": f"line {i} of text"}) for i in range(30)])
    r = stage(data_cfg(src, format="text", eval_fraction=0.2), tokenizer, "builtin", str(tmp_path / "s"))
    row = pq.read_table(tmp_path / "s" / "datasets" / r.dataset_id / "train-00000.parquet").to_pylist()[0]
    real = [(i, lab) for i, lab in zip(row["input_ids"], row["labels"], strict=True) if i != tokenizer.pad_token_id]
    learned = [i for i, lab in real if lab != IGNORE_INDEX]
    assert tokenizer.decode(learned).startswith("line ") and "</s>" in tokenizer.decode(learned)
    assert [i for i, lab in real if lab == IGNORE_INDEX] == [tokenizer.bos_token_id] * tokenizer.decode(learned).count(
        "</s>"
    )


def test_text_format_names_a_missing_text_field(tmp_path: Path, tokenizer) -> None:
    src = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"text": "ok"})] * 20 + [json.dumps({"body": "x"})])
    with pytest.raises(StagingError, match=r"t\.jsonl:21: missing field 'text'"):
        stage(data_cfg(src, format="text"), tokenizer, "builtin", str(tmp_path / "s"))


def chat(i: int, last: str = "assistant") -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": last, "content": str(i + 1)}]})


def test_chat_format_without_a_chat_template_is_a_clear_error(tmp_path: Path, tokenizer) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(20)])
    with pytest.raises(StagingError, match="data.format=chat needs a tokenizer with a chat template"):
        stage(data_cfg(src, format="chat"), tokenizer, "my-model", str(tmp_path / "s"))


def test_chat_format_renders_the_template_and_learns_only_the_replies(tmp_path: Path) -> None:
    tok = train_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    lines = [chat(i) for i in range(30)] + [chat(99, last="user")]
    src = write_jsonl(tmp_path / "c.jsonl", lines)
    with pytest.raises(StagingError, match=r"c\.jsonl:31: the last message must be the assistant's"):
        stage(data_cfg(src, format="chat"), tok, "builtin", str(tmp_path / "s"))
    write_jsonl(src, lines[:30])
    r = stage(data_cfg(src, format="chat", eval_fraction=0.2), tok, "builtin", str(tmp_path / "s"))
    row = pq.read_table(tmp_path / "s" / "datasets" / r.dataset_id / "train-00000.parquet").to_pylist()[0]
    text = tok.decode([i for i in row["input_ids"] if i != tok.pad_token_id])
    learned = tok.decode([i for i, lab in zip(row["input_ids"], row["labels"], strict=True) if lab != IGNORE_INDEX])
    assert "[user] " in text and "[assistant] " in text
    assert "[user]" not in learned and "[assistant]" not in learned and "?" not in learned


def test_parquet_sources_are_validated_row_by_row(tmp_path: Path, tokenizer) -> None:
    import pyarrow as pa

    rows = [{"input": f"{i}+1=", "target": str(i + 1)} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "good.parquet")
    r = stage(data_cfg(tmp_path / "good.parquet"), tokenizer, "builtin", str(tmp_path / "s"))
    assert r.manifest.counts.records == 40

    bad = rows[:9] + [{"input": "9+1=", "target": None}] + rows[10:]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(StagingError, match=r"bad\.parquet:row 10: field 'target' must be a string, got NoneType"):
        stage(data_cfg(tmp_path / "bad.parquet"), tokenizer, "builtin", str(tmp_path / "s"))


def test_a_folder_mixing_jsonl_and_parquet_is_one_source(tmp_path: Path, tokenizer) -> None:
    import pyarrow as pa

    (tmp_path / "src").mkdir()
    write_jsonl(tmp_path / "src" / "a.jsonl", [good(i) for i in range(20)])
    pq.write_table(pa.Table.from_pylist([json.loads(good(i)) for i in range(20, 45)]), tmp_path / "src" / "b.parquet")
    r = stage(data_cfg(tmp_path / "src"), tokenizer, "builtin", str(tmp_path / "s"))
    assert r.manifest.counts.records == 45
    assert [s.url.rsplit("/", 1)[1] for s in r.manifest.sources["train"]] == ["a.jsonl", "b.parquet"]


def test_a_saved_hf_dataset_folder_is_a_source(tmp_path: Path, tokenizer) -> None:
    import datasets

    rows = [json.loads(good(i)) for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    r = stage(data_cfg(tmp_path / "hf"), tokenizer, "builtin", str(tmp_path / "s"))
    assert r.manifest.counts.records == 30
    assert r.manifest.sources["train"][0].url.endswith(".arrow")
    assert stage(data_cfg(tmp_path / "hf"), tokenizer, "builtin", str(tmp_path / "s")).cache_hit

    bad = rows[:4] + [{"input": "", "target": "1"}] + rows[5:]
    datasets.Dataset.from_list(bad).save_to_disk(str(tmp_path / "hf-bad"))
    with pytest.raises(StagingError, match=r"data-00000-of-00001\.arrow:row 5: field 'input' is empty"):
        stage(data_cfg(tmp_path / "hf-bad"), tokenizer, "builtin", str(tmp_path / "s"))

    too_long = rows[:6] + [{"input": "1" * 80, "target": "1"}] + rows[7:]  # tokenizes past data.seq_len=64
    datasets.Dataset.from_list(too_long).save_to_disk(str(tmp_path / "hf-long"))
    with pytest.raises(StagingError, match=r"data-00000-of-00001\.arrow:row 7: record is \d+ tokens, longer than"):
        stage(data_cfg(tmp_path / "hf-long"), tokenizer, "builtin", str(tmp_path / "s"))

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(StagingError, match=r"several splits .* point at one, e\.g\. .*dd/train"):
        stage(data_cfg(tmp_path / "dd"), tokenizer, "builtin", str(tmp_path / "s"))


@pytest.mark.parametrize("specials", [True, False])
def test_fast_backend_encoding_matches_the_transformers_call(tokenizer, specials: bool) -> None:
    from ray_jobs.data.tokenize import _encode

    texts = ["12+3=", "<s>[user] hi</s>\n", "é?", " ", "a" * 300]
    enc = tokenizer(texts, add_special_tokens=specials, return_offsets_mapping=True)
    assert [ids for ids, _ in _encode(tokenizer, texts, specials)] == enc["input_ids"]
    assert [list(map(tuple, o)) for _, o in _encode(tokenizer, texts, specials)] == [
        list(map(tuple, o)) for o in enc["offset_mapping"]
    ]
    assert _encode(tokenizer, [], specials) == []
