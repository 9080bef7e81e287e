"""What a dataset event may name: only data under the served config's data.allowed_sources."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from control.sources import SourceRefused, check_allowed_source, rejected_event
from ray_jobs.config import load_config
from tests.conftest import ROOT, SAMPLE_DATA


def served(tmp_path: Path, allowed: list[str] | None = None, train: str = str(SAMPLE_DATA)):
    sets = [f"storage={tmp_path / 'storage'}", "name=served", f"data.train={train}"]
    if allowed is not None:
        sets.append(f"data.allowed_sources={allowed!r}")
    return load_config(ROOT / "configs" / "demo.yaml", sets)


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("{land}/new.jsonl", True),
        ("file://{land}/v2/part-0.parquet", True),
        ("{land}", True),
        ("{land}/../secret.jsonl", False),  # traversal out of the folder
        ("{land}box/x.jsonl", False),  # a sibling whose name starts the same
        ("/etc/passwd", False),
        ("file:///etc/passwd", False),
        ("http://169.254.169.254/latest/meta-data", False),  # another protocol
        ("s3://bucket/in/x.jsonl", True),
        ("s3://bucket/in/../other/x.jsonl", False),
        ("s3://bucket/inbox/x.jsonl", False),
        ("s3://other/in/x.jsonl", False),
        ("gs://bucket/in/x.jsonl", False),
    ],
)
def test_only_uris_under_an_allowed_prefix_pass(tmp_path: Path, uri: str, ok: bool) -> None:
    land = tmp_path / "land"
    land.mkdir()
    cfg = served(tmp_path, [str(land), "s3://bucket/in/"])
    target = uri.format(land=land)
    if ok:
        assert check_allowed_source(cfg, target) == target
    else:
        with pytest.raises(SourceRefused, match="data.allowed_sources"):
            check_allowed_source(cfg, target)


def test_a_symlink_out_of_an_allowed_folder_is_refused(tmp_path: Path) -> None:
    land = tmp_path / "land"
    land.mkdir()
    os.symlink("/etc", land / "etc")
    with pytest.raises(SourceRefused):
        check_allowed_source(served(tmp_path, [str(land)]), str(land / "etc" / "passwd"))


def test_without_a_list_the_folder_holding_data_train_is_allowed(tmp_path: Path) -> None:
    cfg = served(tmp_path)
    assert check_allowed_source(cfg, str(SAMPLE_DATA.parent / "other.jsonl"))
    with pytest.raises(SourceRefused, match=str(SAMPLE_DATA.parent)):
        check_allowed_source(cfg, "file:///etc/passwd")
    remote = served(tmp_path, train="s3://b/data/train.jsonl")
    assert check_allowed_source(remote, "s3://b/data/v2.jsonl")
    with pytest.raises(SourceRefused):
        check_allowed_source(remote, "s3://b/elsewhere.jsonl")


def test_a_refusal_is_an_event_with_the_reason(tmp_path: Path, asserting_events) -> None:
    from prefect.events.worker import EventsWorker

    rejected_event(served(tmp_path), "file:///etc/passwd", "not under data.allowed_sources")
    EventsWorker.drain_all()
    events = [e for c in asserting_events.all for e in c.events]
    assert [(e.event, e.resource.id) for e in events] == [("unbroken.dataset.rejected", "unbroken.run.served")]
    assert events[0].payload["dataset_uri"] == "file:///etc/passwd"
    assert events[0].payload["allowed"] == [str(SAMPLE_DATA.parent)]
