"""A hub dataset as ``data.train``: read through the ``datasets`` library and its caches, offline, staged like any
file and content-addressed by its rows; a dataset in no cache is one line that says what to do, at once.

The caches are written the way the Hugging Face tools leave them: the hub cache as ``hf download --repo-type dataset
owner/name`` does (``datasets--owner--name/{blobs,snapshots/<commit>,refs/main}`` under ``HF_HUB_CACHE``), and the
``datasets`` cache as an online ``load_dataset("owner/name")`` does (``owner___name/<config>/<version>/<hash>/``
holding ``dataset_info.json`` and ``name-<split>.arrow``). No network: the hub is offline throughout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ray_jobs.config import DataConfig
from ray_jobs.data import hub
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.errors import UserError
from ray_jobs.model.builtin import train_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer()


@pytest.fixture
def caches(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(the datasets cache, the hub cache) of this test, the hub offline as ``HF_HUB_OFFLINE=1`` makes it."""
    import datasets.config
    import huggingface_hub.constants

    ds_cache, hub_cache = tmp_path / "hf" / "datasets", tmp_path / "hf" / "hub"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", ds_cache)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return ds_cache, hub_cache


def rows(n: int, offset: int = 0) -> bytes:
    return b"".join(
        json.dumps({"input": f"{i}+{i}=", "target": str(2 * i + offset)}).encode() + b"\n" for i in range(n)
    )


def downloaded(hub_cache: Path, repo: str, files: dict[str, bytes], commit: str) -> Path:
    """What ``hf download --repo-type dataset <repo>`` leaves for one commit: content-addressed blobs, the snapshot's
    files as links to them, and ``refs/main`` naming the commit. Returns the snapshot folder."""
    root = hub_cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def loaded_online(ds_cache: Path, repo: str, snapshot: Path) -> Path:
    """What an online ``load_dataset(repo)`` leaves in the datasets cache: the split prepared as Arrow under
    ``owner___name/default/0.0.0/<hash>/`` (prepared here from the downloaded snapshot, then put where a load by hub
    id puts it, its files named after the dataset)."""
    import datasets

    datasets.load_dataset(str(snapshot), split="train")  # prepares <commit>/default/0.0.0/<hash>/
    prepared = next((ds_cache / snapshot.name / "default" / "0.0.0").glob("*/dataset_info.json")).parent
    owner, name = repo.split("/")
    there = ds_cache / f"{owner}___{name}" / "default" / "0.0.0" / prepared.name
    shutil.copytree(prepared, there)
    (there / f"{snapshot.name}-train.arrow").rename(there / f"{name}-train.arrow")
    shutil.rmtree(ds_cache / snapshot.name)
    return there


def hub_data(tmp_path: Path, **source) -> DataConfig:
    return DataConfig(train=source, seq_len=64, min_shards=2, work_dir=str(tmp_path / "work"))


def test_a_downloaded_hub_dataset_stages_offline_as_load_dataset_reads_it(tmp_path, caches, tokenizer) -> None:
    import datasets

    snapshot = downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(300)}, "a" * 40)
    r = stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s"))
    (staged,) = r.manifest.sources["train"]
    assert staged.url.startswith(str(tmp_path / "work" / "hub" / "someone--tiny")) and staged.url.endswith(".parquet")
    expected = datasets.load_dataset(str(snapshot), split="train")
    assert pq.read_table(staged.url).to_pylist() == expected.to_list(), "the rows load_dataset reads, in order"
    assert r.manifest.counts.records == 300 and r.manifest.counts.rejects == 0
    again = stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s2"))
    assert again.dataset_id == r.dataset_id, "the same rows: the same dataset"


def test_a_new_revision_with_other_rows_is_a_new_dataset_and_a_pinned_one_is_not(tmp_path, caches, tokenizer) -> None:
    downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(300)}, "a" * 40)
    first = stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s")).dataset_id
    downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(300, offset=1)}, "b" * 40)  # refs/main moved
    newer = stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s")).dataset_id
    pinned = hub_data(tmp_path, hub="someone/tiny", revision="a" * 40)
    assert newer != first
    assert stage(pinned, tokenizer, "char", str(tmp_path / "s")).dataset_id == first


def test_the_datasets_cache_an_online_load_left_is_read_offline_as_one_dataset(tmp_path, caches, tokenizer) -> None:
    snapshot = downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(300)}, "a" * 40)
    from_hub_cache = stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s")).dataset_id
    loaded_online(caches[0], "someone/tiny", snapshot)
    shutil.rmtree(caches[1])  # only the datasets cache has it now
    shutil.rmtree(tmp_path / "work")
    r = stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s"))
    assert r.dataset_id == from_hub_cache, "the id follows the rows, not the cache they were read from"


def test_an_offline_miss_is_one_line_naming_the_id_the_caches_and_what_to_do(tmp_path, caches, tokenizer) -> None:
    with pytest.raises(StagingError) as e:
        stage(hub_data(tmp_path, hub="someone/absent"), tokenizer, "char", str(tmp_path / "s"))
    said = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in said, said
    assert said.startswith("data.train: hub dataset someone/absent is not in the local caches"), said
    assert str(caches[0]) in said and str(caches[1]) in said and "HF_HUB_OFFLINE is set" in said, said
    assert "run `hf download --repo-type dataset someone/absent` where the hub is reachable" in said, said


def test_an_unreachable_hub_is_looked_at_once_then_the_caches_are_read(
    tmp_path, caches, monkeypatch, tokenizer
) -> None:
    import huggingface_hub

    looks = []

    class Unreachable:
        def head(self, url, timeout):
            looks.append((url, timeout))
            raise ConnectionRefusedError("no route")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "get_session", Unreachable)
    monkeypatch.setattr(hub, "_unanswered", {})
    downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(100)}, "a" * 40)
    assert stage(hub_data(tmp_path, hub="someone/tiny"), tokenizer, "char", str(tmp_path / "s")).manifest.counts.records
    with pytest.raises(StagingError, match=r"the hub \(https://\S+\) does not answer \(ConnectionRefusedError\)"):
        stage(hub_data(tmp_path, hub="someone/absent"), tokenizer, "char", str(tmp_path / "s"))
    assert len(looks) == 1 and looks[0][1] == hub.PROBE_TIMEOUT_S, "one short look, no retry, standing a while"
    monkeypatch.setattr(hub, "UNANSWERED_S", 0.0)
    with pytest.raises(StagingError, match="does not answer"):
        stage(hub_data(tmp_path, hub="someone/absent"), tokenizer, "char", str(tmp_path / "s"))
    assert len(looks) == 2, "looked at again once it no longer stands"


def test_a_split_or_subset_the_dataset_has_not_is_named(tmp_path, caches, tokenizer) -> None:
    downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(50)}, "a" * 40)
    (tmp_path / "a.jsonl").write_bytes(rows(50))
    sources = [{"path": str(tmp_path / "a.jsonl")}, {"hub": "someone/tiny", "split": "test"}]
    with pytest.raises(StagingError, match=r"data.train\[1\]: hub:someone/tiny \(split=test\): Unknown split"):
        stage(DataConfig(train=sources, work_dir=str(tmp_path / "work")), tokenizer, "char", str(tmp_path / "s"))
    with pytest.raises(StagingError, match=r"data.train: hub:someone/tiny \(split=train, subset=nope\): .*'nope'"):
        stage(hub_data(tmp_path, hub="someone/tiny", subset="nope"), tokenizer, "char", str(tmp_path / "s"))


def test_a_hub_dataset_is_a_source_of_a_mixture_too(tmp_path, caches, tokenizer) -> None:
    downloaded(caches[1], "someone/tiny", {"data/train.jsonl": rows(200, offset=3)}, "a" * 40)
    (tmp_path / "a.jsonl").write_bytes(rows(400))
    sources = [{"path": str(tmp_path / "a.jsonl"), "weight": 1}, {"hub": "someone/tiny", "weight": 1}]
    r = stage(DataConfig(train=sources, seq_len=64, work_dir=str(tmp_path / "w")), tokenizer, "c", str(tmp_path / "s"))
    local, from_hub = r.manifest.mixture
    assert from_hub.where == "hub:someone/tiny (split=train)" and from_hub.records == 200
    assert from_hub.staged_rows == local.staged_rows == local.rows, "equal weights: as many rows as the bigger"


def test_stage_and_run_say_an_offline_miss_in_one_line_before_prefect(tmp_path) -> None:
    """The commands, as a user's quiet terminal shows them: the miss found by the first checks, exit 2."""
    import subprocess
    import sys

    config = tmp_path / "hub.yaml"
    config.write_text(f"name: hubby\nstorage: {tmp_path / 's'}\ndata:\n  train: {{hub: someone/absent}}\n")
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_VERBOSE"}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for command in ("stage", "run"):
        argv = [sys.executable, "-m", "unbroken", command, str(config), "--set", "cluster.dashboard_port=8598"]
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        lines = (p.stdout + p.stderr).strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (command, lines)
        assert lines[0].startswith("error: data.train: hub dataset someone/absent is not in the local caches"), lines
