"""The series record and the champion pointer as typed records: files written before they were typed load and
round-trip unchanged (plus ``schema_version``), a field this version does not know is refused naming the file and the
field, and the typed code writes the keys the untyped code wrote.

The golden files in ``series_golden/`` were written by the untyped series code (a champion, a rejected challenger,
a final folder deleted by retention, a warm-started run still training); only the eval pin and the champion's folder
were edited to look like a real storage's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from control import series
from control.records.series import ChampionPointer, SeriesRecord
from control.series import promotion
from ray_jobs.contracts.base import RecordError
from tests.unit.test_series import _finished_run, _run

GOLDEN = Path(__file__).parent / "series_golden"


def _as_written(tree: dict) -> str:
    """What write_json_atomic puts on storage for a tree."""
    return json.dumps(tree, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize(("model", "name"), [(SeriesRecord, "series.json"), (ChampionPointer, "champion.json")])
def test_a_file_in_todays_format_loads_and_writes_back_the_same_bytes_plus_its_version(model, name) -> None:
    text = (GOLDEN / name).read_text()
    record = model.parse(json.loads(text), name)
    tree = record.dump()
    assert tree.pop("schema_version") == 1, "a file without a version is version 1, and says so once rewritten"
    assert _as_written(tree) == text


def test_the_typed_fields_read_as_the_untyped_entries_said() -> None:
    rec = SeriesRecord.parse(json.loads((GOLDEN / "series.json").read_text()), "series.json")
    assert rec.champion_entry().run == "sums-b" and rec.eval.source == "the eval split of run sums-a"
    a, b, c, d = rec.runs
    assert a.final_deleted_at is not None and a.verdict.promoted and a.verdict.champion is None
    assert b.parent == "sums-a" and b.verdict.champion_score == 1.0
    assert not c.verdict.promoted and "does not beat" in c.verdict.why
    assert (d.verdict, d.score, d.ended_at, d.parent) == (None, None, None, "sums-b"), "still training"
    assert d.flow_run_id == "3f1c2b9e-6a0d-4d55-9a51-2f8e0c1d7a42"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda t: t["runs"][1].update(note="hand-edited"), "series.json: runs.1.note: Extra inputs are not permitted"),
        (lambda t: t["runs"][0]["verdict"].update(by="me"), "runs.0.verdict.by: Extra inputs are not permitted"),
        (lambda t: t.update(owner="team-a"), "series.json: owner: Extra inputs are not permitted"),
        (lambda t: t["runs"][2].update(score="low"), "runs.2.score: Input should be a valid number"),
        (lambda t: t.update(schema_version=9), "schema_version 9 is newer than this unbroken reads (1)"),
        (lambda t: t.update(schema_version="2"), "series.json: schema_version: not a version number ('2')"),
        (lambda t: t.update(schema_version=None), "series.json: schema_version: not a version number (None)"),
    ],
)
def test_an_unknown_field_or_a_wrong_value_is_refused_naming_the_file_and_the_field(change, says) -> None:
    tree = json.loads((GOLDEN / "series.json").read_text())
    change(tree)
    with pytest.raises(RecordError) as e:
        SeriesRecord.parse(tree, "series.json")
    assert says in str(e.value), str(e.value)


def test_an_unknown_field_in_the_champion_pointer_is_refused_too() -> None:
    tree = json.loads((GOLDEN / "champion.json").read_text()) | {"signed_by": "ci"}
    with pytest.raises(RecordError, match="champion.json: signed_by: Extra inputs are not permitted"):
        ChampionPointer.parse(tree, "champion.json")


def _keys(tree: object, at: str = "") -> set[str]:
    """Every key path in a JSON tree (list items share their list's path)."""
    if isinstance(tree, dict):
        return {f"{at}.{k}" for k in tree} | {p for k, v in tree.items() for p in _keys(v, f"{at}.{k}")}
    if isinstance(tree, list):
        return {p for v in tree for p in _keys(v, f"{at}[]")}
    return set()


def test_the_typed_code_writes_the_keys_the_untyped_code_wrote(tmp_path, monkeypatch) -> None:
    """The golden lineage again, through the typed code: the same keys (and ``schema_version``), the same
    sha256s in the champion pointer (same bytes, hashed with hashlib.file_digest now)."""
    monkeypatch.setattr(promotion, "_emit", lambda v: None)
    for name, dataset, score, parent in [("sums-a", "ds-a", 1.0, None), ("sums-b", "ds-b", 0.8, "sums-a"),
                                         ("sums-c", "ds-c", 0.95, None)]:  # fmt: skip
        c = _run(tmp_path, name, **{"series.keep_runs": 1})
        _finished_run(c, dataset, score, parent=parent)
        series.finish_run(c.storage, name)
    series.begin_run(_run(tmp_path, "sums-d"), "ds-d", series.pinned_eval(c), "sums-b", "flow-run-d")
    written = json.loads((tmp_path / "series" / "sums" / "series.json").read_text())
    golden = json.loads((GOLDEN / "series.json").read_text())
    assert _keys(written) == _keys(golden) | {".schema_version"}
    pointer = json.loads((tmp_path / "series" / "sums" / "champion.json").read_text())
    old_pointer = json.loads((GOLDEN / "champion.json").read_text())
    assert set(pointer) == set(old_pointer) | {"schema_version"} and pointer["files"] == old_pointer["files"]
