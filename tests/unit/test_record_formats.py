"""``data.format`` is a table: each record format one descriptor (ray_jobs/config/record_formats.py) and one shape
(ray_jobs/data/shapes.py's ``SHAPES``), read where staging, the workers, the samples and ``check`` used to branch on
the format's name -- so a new record format is its row in each, and the config's literal names it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest

import ray_jobs.config.record_formats as record_formats
import ray_jobs.data.shapes as shapes
from ray_jobs.config import DataConfig
from ray_jobs.config.data import Format
from ray_jobs.config.record_formats import FORMATS, RecordFormat, record_format, staged_format
from ray_jobs.data.records import parse_records, record_char_limit
from ray_jobs.data.shapes import SHAPES, Shaped, fields_of, resolve_format, string_field
from ray_jobs.data.sources import SourceFile
from ray_jobs.data.staging import packer_for, staging_config


def test_the_config_literal_names_every_format_of_the_table() -> None:
    """The literal is what validates a config and what the reference lists; the table is what the code reads."""
    assert sorted(get_args(Format)) == sorted(FORMATS)
    assert len(get_args(Format)) == len(FORMATS)


def test_every_format_but_the_detected_one_has_a_shape() -> None:
    detected = {name for name, f in FORMATS.items() if f.detected}
    assert detected == {"auto"}
    assert set(SHAPES) == set(FORMATS) - detected


def test_each_descriptor_says_what_its_branches_said() -> None:
    assert [n for n, f in FORMATS.items() if f.pairs] == ["preference"]
    assert [n for n, f in FORMATS.items() if f.labelled] == ["unpaired_preference"]
    assert [n for n, f in FORMATS.items() if f.documents] == ["text"]
    always, if_template = {"chat", "sharegpt"}, {"alpaca", "prompt_completion", "preference", "unpaired_preference"}
    assert {n for n, f in FORMATS.items() if f.chat == "always"} == always
    assert {n for n, f in FORMATS.items() if f.chat == "if_template"} == if_template
    for f in FORMATS.values():  # a format that refuses a tokenizer without a template says what to do instead
        assert bool(f.no_template) == (f.chat == "always"), f.name
        assert all(s in DataConfig.model_fields for s in f.field_settings), f.name
    assert {n: f.train_on for n, f in FORMATS.items() if f.train_on} == {
        "preference": "last_assistant",
        "unpaired_preference": "last_assistant",
    }
    assert record_format("text").unit == "pieces" and record_format("chat").unit == "records"


def test_an_unknown_format_is_named_and_a_staged_mixture_is_no_one_format() -> None:
    with pytest.raises(
        ValueError, match=r"data.format='jsonl' is not a record format \(one of preference, unpaired_preference, chat"
    ):
        record_format("jsonl")
    for name in ("mixed", ""):  # a mixture's staged format, and a manifest naming none
        f = staged_format(name)
        assert not (f.pairs or f.documents or f.detected)
    assert staged_format("text") is FORMATS["text"]


def test_auto_tries_the_formats_in_the_tables_order_with_the_configs_field_names() -> None:
    data = DataConfig(train="x.jsonl", input_field="q", target_field="a", messages_field="dialog")
    assert fields_of("pairs", data) == ("q", "a") and fields_of("chat", data) == ("dialog",)
    assert fields_of("preference", data) == ("prompt", "chosen", "rejected")
    assert shapes.shape_of(["prompt", "chosen", "rejected", "completion"], data) == "preference"
    assert shapes.shape_of(["prompt", "completion"], data) == "prompt_completion"
    assert shapes.shape_of(["prompt", "completion", "label"], data) == "unpaired_preference"
    assert shapes.shape_of(["text", "q", "a"], data) == "pairs"


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> RecordFormat:
    """A toy format, ``qa`` (``question`` and ``answer`` strings), registered as a new format is: its row in the
    table and its shape in ``SHAPES`` -- nothing else."""

    def qa(obj: dict, data: DataConfig, templated: bool) -> Shaped:
        return Shaped(prompt=string_field(obj, "question", "qa") + "\n", target=string_field(obj, "answer", "qa"))

    row = RecordFormat("qa", fields=("question", "answer"))
    monkeypatch.setattr(record_formats, "FORMATS", {"qa": row, **FORMATS})  # tried first by auto
    monkeypatch.setattr(shapes, "FORMATS", record_formats.FORMATS)
    monkeypatch.setitem(SHAPES, "qa", qa)
    return row


def test_a_new_format_is_its_row_and_its_shape(tmp_path: Path, toy: RecordFormat) -> None:
    src = tmp_path / "qa.jsonl"
    records = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": " "}]
    src.write_text("".join(json.dumps(o) + "\n" for o in records))
    data = resolve_format(DataConfig(train=str(src), format="auto"))
    assert data.format == "qa"  # detected by its fields
    (rec,), (rej,) = parse_records(SourceFile(str(src), src.read_bytes()), data)
    assert (rec.prompt, rec.target, rec.text, rec.learn) == ("1+1?\n", "2", "1+1?\n2", [(5, 6)])
    assert rej.reason == "field 'answer' is empty"
    assert record_char_limit(data) == 100_000 and packer_for(data).__name__ == "Packer"
    assert "too_long" in staging_config(data) and "train_on" not in staging_config(data)
    as_chat = replace(toy, chat="if_template")  # a property of the row, not of the name
    record_formats.FORMATS["qa"] = as_chat
    assert "train_on" in staging_config(data)
