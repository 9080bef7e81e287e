"""A mixture: ``data.train`` as several weighted sources. The weights are shares of the staged train rows, each row
from one source, every shard holding each source's share, the manifest naming the source of every row; staged the
same twice over (one dataset id), resumed exactly, each reject named by its source's file and line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ray_jobs.config import ConfigError, DataConfig, load_config
from ray_jobs.data import spill as spill_module
from ray_jobs.data.mixture import picks, staged_rows, train_sources
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.model.builtin import train_char_tokenizer
from tests.conftest import ROOT

DEMO = str(ROOT / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer()


def sums(path: Path, n: int, op: str, bad_at: int | None = None) -> Path:
    """``n`` records of the same length each ("a op b=" -> c), a bad one at line ``bad_at``."""
    lines = [json.dumps({"input": f"{100 + i % 900}{op}{100 + i % 7}=", "target": "x" * 4}) for i in range(n)]
    if bad_at is not None:
        lines.insert(bad_at - 1, json.dumps({"input": "no target"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def mixture(tmp_path: Path, a_weight: float = 3, b_weight: float = 1, **kw) -> DataConfig:
    a, b = sums(tmp_path / "a.jsonl", 1200, "+"), sums(tmp_path / "b.jsonl", 300, "*", kw.pop("bad_at", None))
    sources = [{"path": str(a), "weight": a_weight}, {"path": str(b), "weight": b_weight}]
    return DataConfig(train=sources, seq_len=64, shard_mb=0.01, min_shards=4, work_dir=str(tmp_path / "w"), **kw)


def rows_by_source(storage: Path, manifest) -> tuple[Counter, Counter]:
    """(train rows per source as the manifest names them, the same as the rows' own tokens tell)."""
    named, told = Counter(), Counter()
    tok = train_char_tokenizer()
    for shard in manifest.shards["train"]:
        ids = pq.read_table(storage / "datasets" / manifest.dataset_id / shard.file).column("input_ids").to_pylist()
        for row, row_ids in enumerate(ids):
            source = manifest.source_of(shard.file, row)
            text = tok.decode(row_ids)
            assert ("+" in text) != ("*" in text), f"a row holds records of one source: {text!r}"
            named[source] += 1
            told["data.train[0]" if "+" in text else "data.train[1]"] += 1
    return named, told


def test_a_3_to_1_mixture_stages_train_rows_3_to_1_each_named_by_its_source(tmp_path, tokenizer) -> None:
    r = stage(mixture(tmp_path), tokenizer, "char", str(tmp_path / "s"))
    named, told = rows_by_source(tmp_path / "s", r.manifest)
    assert named == told, "the manifest names each row's source"
    a, b = r.manifest.mixture
    assert (a.rows, a.staged_rows) == (named["data.train[0]"], named["data.train[0]"]), "the heaviest staged once"
    assert b.staged_rows == named["data.train[1]"] == round(a.rows / 3) and b.repeats > 1, "upsampled to a third"
    assert r.manifest.counts.train_rows == a.staged_rows + b.staged_rows
    for shard in r.manifest.shards["train"]:  # every shard (every data rank) trains the mixture
        shares = {p.source: p.rows for p in shard.sources}
        assert abs(shares["data.train[0]"] - 3 * shares["data.train[1]"]) <= 4, shares


def test_a_mixture_stages_the_same_twice_and_resumes_exactly(tmp_path, tokenizer, monkeypatch) -> None:
    whole = stage(mixture(tmp_path), tokenizer, "char", str(tmp_path / "s1"))
    again = stage(mixture(tmp_path), tokenizer, "char", str(tmp_path / "s2"))
    assert again.dataset_id == whole.dataset_id and again.manifest.dump() == whole.manifest.dump()
    monkeypatch.setattr("ray_jobs.data.staging.BATCH_BYTES", 2000)  # many pieces, each a commit
    monkeypatch.setattr("ray_jobs.data.staging.COMMIT_BATCHES", 1)
    real, added = spill_module.Spill.add, []
    kill_at = (tmp_path / "a.jsonl").stat().st_size // 2000 + 4  # a few pieces into the second source

    def killed(self, result):
        if len(added) == kill_at:
            raise KeyboardInterrupt("killed mid-staging")
        added.append(1)
        real(self, result)

    with monkeypatch.context() as m:
        m.setattr(spill_module.Spill, "add", killed)
        with pytest.raises(KeyboardInterrupt):
            stage(mixture(tmp_path), tokenizer, "char", str(tmp_path / "s3"))
    progress = json.loads(next((tmp_path / "w").glob("ds-*/progress.json")).read_text())
    assert progress["file"] == 1 and len(progress["marks"]) == 1, "killed in the second source, the first marked"
    resumed = stage(mixture(tmp_path), tokenizer, "char", str(tmp_path / "s3"))
    assert resumed.manifest.dump() == whole.manifest.dump(), "the same shards, byte for byte"


def test_weights_set_the_shares_whatever_the_order_of_the_sources(tmp_path, tokenizer) -> None:
    one = stage(mixture(tmp_path, 1, 1), tokenizer, "char", str(tmp_path / "s"))
    a, b = one.manifest.mixture
    assert a.staged_rows == b.staged_rows == max(a.rows, b.rows), "equal weights: the bigger staged once"
    sub = stage(mixture(tmp_path, 1, 8), tokenizer, "char", str(tmp_path / "s"))
    a, b = sub.manifest.mixture
    assert (b.staged_rows, a.staged_rows) == (b.rows, round(b.rows / 8)) and a.repeats < 1, "a: subsampled"


def test_the_row_choice_is_a_fixed_hash_of_each_rows_index() -> None:
    assert staged_rows([100, 30], [3, 1]) == [100, 33] and staged_rows([10, 30], [1, 1000]) == [1, 30]
    chosen = picks(10, 25, salt=1)
    assert sorted(Counter(chosen.tolist()).values()) == [2] * 5 + [3] * 5 and list(chosen[:10]) == list(range(10))
    assert np.array_equal(picks(10, 25, salt=1), chosen) and not np.array_equal(picks(10, 25, salt=2), chosen)
    assert list(picks(10, 4, salt=1)) == sorted(picks(10, 4, salt=1)), "a subsample keeps the rows' order"


def test_each_sources_rejects_are_named_by_its_file_and_line(tmp_path, tokenizer) -> None:
    with pytest.raises(StagingError, match=r"1 of 1501 records rejected .*\n  .*b\.jsonl:7: missing field 'target'"):
        stage(mixture(tmp_path, bad_at=7), tokenizer, "char", str(tmp_path / "s"))
    r = stage(mixture(tmp_path, bad_at=7, max_reject_fraction=0.01), tokenizer, "char", str(tmp_path / "s"))
    rejects = (tmp_path / "s" / "datasets" / r.dataset_id / "rejects.jsonl").read_text().splitlines()
    assert [json.loads(x)["file"] for x in rejects] == [str(tmp_path / "b.jsonl")]
    assert r.manifest.mixture[1].rejects == 1 and r.manifest.mixture[0].rejects == 0


def test_each_source_is_read_in_its_own_format(tmp_path, tokenizer) -> None:
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"some text number {i} *"}) + "\n" for i in range(300)))
    sources = [{"path": str(sums(tmp_path / "a.jsonl", 600, "+"))}, {"path": str(texts), "format": "text"}]
    data = DataConfig(train=sources, seq_len=64, min_shards=2, work_dir=str(tmp_path / "w"))
    r = stage(data, tokenizer, "char", str(tmp_path / "s"))
    assert [m.format for m in r.manifest.mixture] == ["pairs", "text"] and r.manifest.format == "mixed"
    assert r.manifest.counts.documents == 300 and r.manifest.counts.rejects == 0


def test_one_source_in_a_list_is_the_dataset_its_path_alone_is(tmp_path, tokenizer) -> None:
    a = sums(tmp_path / "a.jsonl", 300, "+")
    plain = stage(DataConfig(train=str(a), seq_len=64, min_shards=2), tokenizer, "char", str(tmp_path / "s"))
    listed = DataConfig(train=[{"path": str(a), "weight": 5}], seq_len=64, min_shards=2)
    assert stage(listed, tokenizer, "char", str(tmp_path / "s")).dataset_id == plain.dataset_id
    assert not plain.manifest.mixture and "mixture" not in plain.manifest.dump()


def test_train_sources_names_each_source_for_the_check(tmp_path) -> None:
    data = mixture(tmp_path, format="chat")
    a, b = train_sources(data)
    assert (a.field, a.url, a.format, a.weight) == ("data.train[0]", str(tmp_path / "a.jsonl"), "chat", 3.0)
    assert (b.field, b.weight, b.where) == ("data.train[1]", 1.0, str(tmp_path / "b.jsonl"))
    assert train_sources(DataConfig(train="x.jsonl"))[0].field == "data.train"


@pytest.mark.parametrize(
    ("train", "says"),
    [
        ("[{path: a.jsonl}, {path: b.jsonl, weight: 0}]", "data.train[1].weight: Input should be greater than 0"),
        ("[{path: a.jsonl}, {path: b.jsonl, colour: red}]", "data.train[1].colour: unknown key"),
        ("[]", "data.train: an empty list names no source"),
        ("[{path: a.jsonl, hub: o/n}]", "data.train[0]: give exactly one of path"),
        ("[a.jsonl, {hub: o/n, split: 'train[:10%]'}]", "data.train[1].split: 'train[:10%]' is not a split's name"),
        ("[a.jsonl, {path: b.jsonl, revision: v1}]", "data.train[1]: split, subset and revision are for a hub dataset"),
        ("[a.jsonl, {path: b.jsonl, format: csv}]", "data.train[1].format: Input should be 'pairs'"),
        ("{hub: not an id}", "data.train: hub: 'not an id' is not a hub dataset id"),
    ],
)
def test_a_bad_source_is_a_config_error_naming_its_entry(train: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [f"data.train={train}"])
    assert says in str(e.value), str(e.value)


def test_the_list_forms_load_with_paths_made_absolute_and_hub_ids_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEMO, ["data.train=[a.jsonl, {path: s3://b/k.jsonl, weight: 2}, {hub: o/n, format: chat}]"])
    assert isinstance(cfg.data.train, list)
    assert [(e.path, e.hub, e.weight) for e in cfg.data.train] == [
        (str(tmp_path / "a.jsonl"), None, 1.0),
        ("s3://b/k.jsonl", None, 2.0),
        (None, "o/n", 1.0),
    ]
    again = type(cfg).model_validate_json(cfg.model_dump_json())  # what a job is given
    assert again.data.train == cfg.data.train
    assert load_config(DEMO, ["data.train=x.jsonl"]).data.train == str(Path.cwd() / "x.jsonl"), "a string as ever"


def test_a_dataset_event_may_point_under_each_path_of_a_mixture(tmp_path) -> None:
    from control.sources import allowed_prefixes

    cfg = load_config(DEMO, [f"data.train=[{tmp_path}/a/x.jsonl, {{path: s3://b/d/y.jsonl}}, {{hub: o/n}}]"])
    assert allowed_prefixes(cfg) == [str(tmp_path / "a"), "s3://b/d"]
