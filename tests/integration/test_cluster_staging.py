"""Staging on the cluster (``data.stage_on: cluster``): Ray actors across the nodes read and tokenize the pieces,
and what lands on storage is byte for byte what staging here writes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import ray_jobs.data.staging as staging
from control.backends.local import head_pids
from tests.conftest import ROOT, SAMPLE_DATA
from tests.integration.conftest import run_cli
from tests.unit.staging_cases import outputs, run_cases

pytestmark = pytest.mark.integration
GOLDEN = json.loads((ROOT / "tests" / "unit" / "staging_golden.json").read_text())
DEMO = str(ROOT / "configs" / "demo.yaml")
PORTS = {"cluster.dashboard_port": 8431, "cluster.head_port": 6531}  # this module's heads, nobody else's


@pytest.fixture(scope="module")
def two_node_ray():
    """A real two-node Ray cluster on this machine (Ray's own test cluster: two raylets), this process its driver."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_staging_on_two_nodes_writes_what_staging_here_wrote(two_node_ray, tmp_path: Path, monkeypatch, caplog):
    """All four pinned cases, cut into ~3 KB pieces so every file is read by actors on both nodes."""
    monkeypatch.setattr(staging, "BATCH_BYTES", 3000)
    caplog.set_level(logging.INFO, logger="unbroken.staging")
    assert run_cases(tmp_path, on="cluster", work_dir=str(tmp_path / "work")) == GOLDEN
    spread = [r.getMessage() for r in caplog.records if "actors on" in r.getMessage()]
    assert spread and all("2 actors on 2 nodes" in m for m in spread), spread


def test_a_bad_record_read_on_the_cluster_fails_naming_its_line(two_node_ray, tmp_path: Path, monkeypatch) -> None:
    """Lines are numbered by pieces that cannot know what came before them: the driver renumbers every reject."""
    from ray_jobs.config import DataConfig
    from ray_jobs.model.builtin import train_char_tokenizer

    monkeypatch.setattr(staging, "BATCH_BYTES", 2000)
    lines = SAMPLE_DATA.read_bytes().splitlines()
    lines[1234] = b'{"input": "1+1=", "target": 2}'
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    data = DataConfig(train=str(src), seq_len=64, work_dir=str(tmp_path / "work"))
    with pytest.raises(staging.StagingError, match=rf"{src}:1235: field 'target' must be a string"):
        staging.stage(data, train_char_tokenizer(), "b", str(tmp_path / "s"), on="cluster")


def test_long_documents_staged_on_two_nodes_are_what_staging_here_wrote(two_node_ray, tmp_path: Path, monkeypatch):
    """Documents past one encoding window: their pieces leave the actors through Ray's object store a chunk at a
    time (here they go through a file beside the spill), and the shards are the same bytes."""
    import random

    import ray_jobs.data.documents as documents
    from ray_jobs.config import DataConfig
    from ray_jobs.model.builtin import train_char_tokenizer
    from tests.unit.test_documents import corpus_text

    monkeypatch.setattr(staging, "BATCH_BYTES", 200_000)
    rng = random.Random(4)
    src, ev = tmp_path / "docs.jsonl", tmp_path / "eval.jsonl"
    sizes = [40, 600_000, 3_000, 700_000, 90]
    src.write_text("".join(json.dumps({"text": corpus_text(rng, n, ascii_only=True)}) + "\n" for n in sizes))
    ev.write_text(json.dumps({"text": "held out"}) + "\n")
    assert max(sizes) > 2 * documents.WINDOW_CHARS
    data = DataConfig(train=str(src), eval=str(ev), format="text", seq_len=256, text_overlap_tokens=8, min_shards=2,
                      work_dir=str(tmp_path / "work"))  # fmt: skip
    there = staging.stage(data, train_char_tokenizer(), "b", str(tmp_path / "there"), on="cluster")
    here = staging.stage(data, train_char_tokenizer(), "b", str(tmp_path / "here"))
    assert there.manifest.counts.cut_documents == 3 and there.dataset_id == here.dataset_id
    assert outputs(tmp_path / "there" / "datasets" / here.dataset_id, []) == outputs(
        tmp_path / "here" / "datasets" / here.dataset_id, []
    )


def sets(storage: Path, **extra: object) -> list[str]:
    base = {"storage": str(storage), "data.cache_dir": str(storage / "_node_cache"), **PORTS}
    return [arg for k, v in {**base, **extra}.items() for arg in ("--set", f"{k}={v}")]


def test_the_stage_flow_stages_on_a_cluster_it_provisions_and_then_stops(tmp_path: Path) -> None:
    from ray_jobs.config import DataConfig
    from ray_jobs.model.loading import load_tokenizer

    mixed = tmp_path / "mixed.jsonl"
    lines = SAMPLE_DATA.read_bytes().splitlines()
    lines[10] = b'{"input": "broken'
    mixed.write_bytes(b"\n".join(lines) + b"\n")
    common = {"data.train": str(mixed), "data.max_reject_fraction": 0.01}
    there = run_cli("stage", DEMO, *sets(tmp_path / "there", **common, **{"data.stage_on": "cluster"}))
    assert there.returncode == 0, there.explain()
    assert "staging on the cluster at http://127.0.0.1:8431" in there.stderr + there.stdout, there.explain()
    assert "staging: 100% (" in there.stderr + there.stdout, "the job's progress reaches the CLI: " + there.explain()
    assert not head_pids(PORTS["cluster.dashboard_port"]), "the head provisioned for staging was stopped"

    # The same staging here, with the tokenizer the flow prepared (the demo's data settings, as the flow had them)
    (model,) = (tmp_path / "there" / "models").iterdir()
    data = DataConfig(train=str(mixed), max_reject_fraction=0.01, seq_len=64, eval_fraction=0.05, shard_mb=1,
                      min_shards=4, work_dir=str(tmp_path / "work"))  # fmt: skip
    here = staging.stage(data, load_tokenizer(str(model)), str(model), str(tmp_path / "here"))
    assert there.stdout.splitlines()[0] == f"dataset id: {here.dataset_id}", there.explain()
    assert outputs(tmp_path / "here" / "datasets" / here.dataset_id, []) == outputs(
        tmp_path / "there" / "datasets" / here.dataset_id, []
    )

    again = run_cli("stage", DEMO, *sets(tmp_path / "there", **common, **{"data.stage_on": "cluster"}))
    assert again.returncode == 0 and "(cache hit)" in again.stdout, again.explain()
    assert "staging on the cluster" not in again.stderr + again.stdout, "a cache hit needs no cluster"


def test_bad_data_staged_on_the_cluster_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("UNBROKEN_EARLY_SCAN_MB", "0")  # found by the staging job, not by the command's first read
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(SAMPLE_DATA.read_bytes() + b'{"input": "1+1="}\n')
    n = len(bad.read_bytes().splitlines())
    r = run_cli("stage", DEMO, *sets(tmp_path / "s", **{"data.train": str(bad), "data.stage_on": "cluster"}))
    assert r.returncode == 2, r.explain()  # a user's mistake (unbroken/errors.py)
    (said,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert said.startswith("error: 1 of"), r.explain()  # the job's message, not "Ray job ... FAILED"
    assert f"{bad}:{n}: missing field 'target'" in r.stderr, r.explain()
    assert "Traceback" not in r.stdout + r.stderr, r.explain()  # neither Ray's (the job's) nor Prefect's
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-3:]  # the message ends the terminal's output
    assert last[0].startswith("error: ") and last[1].strip().endswith("missing field 'target'"), r.explain()
    assert "packaging.py" not in r.stderr, r.explain()  # the job's upload is the job's log, not the terminal's
    assert not head_pids(PORTS["cluster.dashboard_port"]), "the head provisioned for staging was stopped"
