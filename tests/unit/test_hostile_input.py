"""Hostile input is data, not a crash (issue #33, item 10): every case is quarantined (``rejects.jsonl`` names its
file and line, and it counts against ``data.max_reject_fraction``) or refused (one error naming the file and entry,
or the field), never a traceback, never silently dropped."""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path

import pytest

import ray_jobs.data.lines as lines
from control.sources import SourceRefused
from flows.params import run_config
from ray_jobs.config import DataConfig
from ray_jobs.data.lines import LongLine, line_byte_cap
from ray_jobs.data.sources import Position, SourceRange, StagingError, list_sources, pieces, read_range
from ray_jobs.data.staging import stage
from ray_jobs.data.workers import BatchWork
from ray_jobs.model.builtin import train_char_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA

HOSTILE_AT = 2  # the hostile line's number: after one good record, so format auto's detection reads past it too


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer()


def good(i: int) -> bytes:
    return json.dumps({"input": f"{i}+{i}=", "target": str(2 * i)}).encode()


def nested(depth: int) -> bytes:
    """A pairs record with one more field, nested ``depth`` levels deep counting the record itself."""
    return b'{"input": "1+1=", "target": "2", "deep": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def stage_lines(tmp_path: Path, tokenizer, lines_: list[bytes], **data) -> tuple[dict, list[dict]]:
    """Stage ``lines_`` as one JSONL file in this process; the manifest's counts and rejects.jsonl's entries."""
    tmp_path.mkdir(exist_ok=True)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines_) + b"\n")
    cfg = DataConfig(train=str(src), seq_len=512, min_shards=1, workers=1, eval_fraction=0.25,
                     max_reject_fraction=0.1, work_dir=str(tmp_path / "work"), **data)  # fmt: skip
    r = stage(cfg, tokenizer, "builtin", str(tmp_path / "storage"))
    rejects = (tmp_path / "storage" / "datasets" / r.dataset_id / "rejects.jsonl").read_text().splitlines()
    return r.manifest.counts.model_dump(), [json.loads(x) for x in rejects]


LONG = 3 << 20  # over line_byte_cap(100_000), the default data.max_record_chars: 2,248,576 bytes
OVER_CAP = b'{"input": "' + b"x" * LONG + b'", "target": "y"}'
CASES = [
    # (case, the line, data fields, what its reject says; None: a record like any other)
    ("an array nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, {}, "nested deeper than 128 levels"),
    ("an array nested 100,000 deep, detecting the format", b"[" * 100_000 + b"]" * 100_000, {"format": "auto"},
     "nested deeper than 128 levels"),
    ("a field nested 100,000 deep, never closed", b'{"input":' + b"[" * 100_000, {}, "nested deeper than 128"),
    ("objects nested 100,000 deep", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, {}, "nested deeper than 128"),
    ("one level deeper than the limit", nested(129), {}, "nested deeper than 128 levels"),
    ("exactly as deep as the limit", nested(128), {}, None),
    ("brackets inside strings are text", json.dumps({"input": "[" * 150, "target": "{" * 150}).encode(), {}, None),
    ("invalid UTF-8", b'{"input": "\xff\xfe", "target": "x"}', {}, "invalid UTF-8 at byte 11"),
    ("a 3 MB line", OVER_CAP, {}, f"line is {LONG + 28} bytes, over the 2248576-byte limit for "
     "data.max_record_chars=100000"),
    ("a 3 MB line, detecting the format", OVER_CAP, {"format": "auto"}, f"line is {LONG + 28} bytes, over the "
     "2248576-byte limit for data.max_record_chars=100000"),
    ("a 3 MB line under a raised data.max_record_chars: within the cap, read whole, judged as a record", OVER_CAP,
     {"max_record_chars": 300_000}, f"record is {LONG + 1} characters, over data.max_record_chars (300000)"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "data", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_line_is_quarantined_naming_its_file_and_line(tmp_path, tokenizer, line, data, reason) -> None:
    counts, rejects = stage_lines(tmp_path, tokenizer, [good(0), line, *(good(i) for i in range(1, 40))], **data)
    assert counts["records"] == 41  # the hostile line is counted: against data.max_reject_fraction when rejected
    if reason is None:
        assert rejects == [] and counts["rejects"] == 0
        return
    assert counts["rejects"] == 1 and len(rejects) == 1
    assert rejects[0]["file"] == str(tmp_path / "in.jsonl") and rejects[0]["line"] == HOSTILE_AT
    assert reason in rejects[0]["reason"]
    assert len(rejects[0]["text"]) <= 200  # a preview, never the line


def test_hostile_lines_over_the_reject_limit_fail_staging_naming_them(tmp_path, tokenizer) -> None:
    hostile = [b"[" * 100_000, OVER_CAP]
    with pytest.raises(StagingError, match=r"in\.jsonl:2: nested deeper than 128 levels(.|\n)*in\.jsonl:3: line is"):
        stage_lines(tmp_path, tokenizer, [good(0), *hostile, *(good(i) for i in range(1, 10))])


def test_a_60_mb_line_is_quarantined_at_its_line_and_never_held(tmp_path, tokenizer) -> None:
    """Staging reads a file with one 60 MB line among 4,000 records in pieces of 4 MB: the line is rejected naming
    its line (and so is a bad record after it: lines keep their numbers across the pieces the long line spans),
    and the worker's peak Python allocation reading, validating and tokenizing every piece stays far below it."""
    src = tmp_path / "in.jsonl"
    with src.open("wb") as f:
        f.writelines(good(i) + b"\n" for i in range(2_000))
        f.write(b'{"input": "')
        for _ in range(60):
            f.write(b"x" * (1 << 20))
        f.write(b'", "target": "y"}\n')
        f.writelines(good(i) + b"\n" for i in range(2_000, 3_000))
        f.write(b'{"input": "broken\n')
        f.writelines(good(i) + b"\n" for i in range(3_000, 4_000))
    big = (60 << 20) + 28
    cfg = DataConfig(train=str(src), seq_len=64, min_shards=1, workers=1, max_reject_fraction=0.01,
                     work_dir=str(tmp_path / "work"))  # fmt: skip
    r = stage(cfg, tokenizer, "builtin", str(tmp_path / "storage"))
    rejects = (tmp_path / "storage" / "datasets" / r.dataset_id / "rejects.jsonl").read_text().splitlines()
    assert [(x["line"], x["reason"].split(",")[0]) for x in map(json.loads, rejects)] == [
        (2_001, f"line is {big} bytes"),
        (3_002, "invalid JSON: Unterminated string starting at (column 11)"),
    ]
    assert r.manifest.counts.records == 4_002 and r.manifest.counts.train_examples > 0

    work = BatchWork(tokenizer, "builtin", cfg)
    tracemalloc.start()
    try:
        for piece in pieces(str(src), src.stat().st_size, Position(), 4 << 20):
            work(piece, "train")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.1f} MiB"  # a 4 MB piece, the 2.2 MB cap and a block; the line is 60


@pytest.mark.parametrize("piece_bytes", [1, 7, 64, 1000, 1 << 20])
def test_long_lines_keep_their_numbers_wherever_pieces_and_blocks_cut_them(tmp_path, monkeypatch, piece_bytes):
    """With a 24-byte cap and 16-byte blocks, every line over the cap is a LongLine of its size and first bytes, at
    its own line number, whether it lies in one piece, ends one, or spans many."""
    monkeypatch.setattr(lines, "LINE_SLACK_BYTES", 0)
    monkeypatch.setattr(lines, "_BLOCK", 16)
    monkeypatch.setattr(lines, "_SCAN", 8)
    assert line_byte_cap(2) == 24
    file_lines = [b"x" * n for n in (0, 3, 24, 25, 300, 1, 0, 100, 24, 7, 500, 2)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(file_lines))  # no newline after the last
    expect = [(n, raw if len(raw) <= 24 else LongLine(len(raw), raw[:200], 2)) for n, raw in enumerate(file_lines, 1)]
    got, at = [], Position()
    for piece in pieces(str(src), src.stat().st_size, Position(), piece_bytes):
        assert isinstance(piece, SourceRange)
        batch = read_range(piece, max_chars=2)
        got += [(n + at.next - 1, item) for n, item in batch.items]
        at = Position(batch.end.offset, batch.end.next + at.next - 1)
    assert got == expect and at.offset == src.stat().st_size


def test_text_documents_have_no_cap_their_lines_are_read_whole(tmp_path, tokenizer, monkeypatch) -> None:
    """With the cap made 100,000 bytes, a 300,000-character line is a document that stages (cut into pieces) as
    ``text``, and a reject saying how long it is as a pair."""
    monkeypatch.setattr(lines, "LINE_SLACK_BYTES", 0)
    monkeypatch.setattr(lines, "JSON_BYTES_PER_CHAR", 1)
    docs = [json.dumps({"text": f"{i}+{i}={2 * i}"}).encode() for i in range(40)]
    long_doc = json.dumps({"text": "lorem ipsum " * 25_000}).encode()
    counts, rejects = stage_lines(tmp_path / "text", tokenizer, [docs[0], long_doc, *docs[1:]], format="text")
    assert rejects == [] and counts["documents"] == 41 and counts["cut_documents"] == 1
    long_pair = json.dumps({"input": "lorem ipsum " * 25_000, "target": "b"}).encode()
    counts, rejects = stage_lines(tmp_path / "pairs", tokenizer, [good(0), long_pair, *(good(i) for i in range(1, 40))])
    assert [(x["line"], x["reason"]) for x in rejects] == [
        (2, f"line is {len(long_pair)} bytes, over the 100000-byte limit for data.max_record_chars=100000")
    ]


@pytest.mark.parametrize(
    "entry",
    ["../outside.arrow", "sub/../../outside.arrow", "/etc/passwd", "file:///etc/passwd", "http://169.254.169.254/x",
     "s3://bucket/x.arrow", "C:\\outside.arrow", "", "./", 7],
)  # fmt: skip
def test_a_save_to_disk_state_naming_a_file_outside_its_folder_is_refused(tmp_path: Path, entry) -> None:
    (tmp_path / "outside.arrow").write_bytes(b"not yours")
    folder = tmp_path / "hf"
    folder.mkdir()
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}, {"filename": entry}]}
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(StagingError) as e:
        list_sources(str(folder))
    assert str(e.value) == f"{folder}/state.json: _data_files entry {entry!r} is not a file inside the folder; refused"


@pytest.mark.parametrize("state", ["{not json", "[]", '{"_data_files": [{"name": "x.arrow"}]}'])
def test_a_state_json_that_is_not_datasets_is_refused_naming_it(tmp_path: Path, state: str) -> None:
    (tmp_path / "state.json").write_text(state)
    with pytest.raises(StagingError, match="^" + re.escape(f"{tmp_path}/state.json: not a datasets state.json")):
        list_sources(str(tmp_path))


def test_a_save_to_disk_state_of_plain_names_lists_them_in_order(tmp_path: Path) -> None:
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow", "sub/data.arrow"]
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    assert list_sources(str(tmp_path)) == [f"{tmp_path}/{n}" for n in names]


@pytest.mark.parametrize(
    "uri",
    ["'/etc/passwd'", '"/etc/passwd"', "!!str /etc/passwd", "! /etc/passwd", "null", "[/etc/passwd]", "/etc/passwd",
     "file:///etc/passwd", "{land}/../secret.jsonl", "new.jsonl", "{land}/new.jsonl"],
)  # fmt: skip
def test_a_dataset_event_trains_only_on_data_under_the_allowed_sources(tmp_path, monkeypatch, uri: str) -> None:
    """The allow-list judges what staging will read: data.train as the loaded config has it, so a URI that YAML would
    read as another path (quoted, tagged) either stays the relative name it is, under the allowed folder, or is
    refused."""
    land = tmp_path / "land"
    land.mkdir()
    monkeypatch.chdir(land)  # a relative URI resolves here: under the allowed folder
    sets = [f"storage={tmp_path / 'storage'}", "name=served", f"data.train={SAMPLE_DATA}",
            f"data.allowed_sources=[{land}]"]  # fmt: skip
    try:
        cfg = run_config(str(ROOT / "configs" / "demo.yaml"), sets, uri.format(land=land))
    except SourceRefused as e:
        assert "data.allowed_sources" in str(e)
        return
    assert os.path.realpath(cfg.data.train).startswith(f"{land}/"), cfg.data.train
    assert cfg.data.train == str(land / uri.format(land=land).strip())
