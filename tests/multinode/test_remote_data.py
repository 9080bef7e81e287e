"""A run on a remote cluster with data on the flow's machine: the flow stages it to storage from there, the cluster
trains on what was staged, and everything after the export -- the sample generations, the score -- reads staged data
too. The package's hosts are the remote cluster: the data's folder is absent on every one of them (tests/hosts.py
``hidden``), as a laptop's data folder is absent on a cluster it submits to."""

from __future__ import annotations

import json
import shutil

from control.series import score_of
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_registry, run_cli

DEMO = str(ROOT / "configs" / "demo.yaml")


def test_a_remote_cluster_run_with_the_flows_local_data_ends_succeeded_scored_with_samples(
    hosts, cluster, tmp_path
) -> None:
    assert hosts.hidden is not None
    data = hosts.hidden / "addition.jsonl"
    shutil.copy(ROOT / "configs" / "data" / "addition.jsonl", data)
    assert not any(hosts.sees(h, data) for h in hosts.hosts), "the data is the flow's machine's alone"
    storage = tmp_path / "storage"
    sets = tiny_overrides(storage, name="remote", **{"cluster.address": cluster.address, "data.train": str(data)})
    r = run_cli("run", DEMO, *[a for kv in sets for a in ("--set", kv)])
    assert r.returncode == 0, r.explain()

    reg = read_registry(storage, "remote")
    assert reg["state"] == "succeeded" and len(reg["attempts"]) == 1, reg
    assert r.last_line == f"final model: {storage / 'runs' / 'remote' / 'final'}"
    assert score_of(str(storage), "remote") is not None, "scored on the series' eval set"
    samples = json.loads((storage / "runs" / "remote" / "samples.json").read_text())["samples"]
    eval_inputs = {row["input"] for row in map(json.loads, data.read_text().splitlines())}
    assert samples and all(s["prompt"].strip() in eval_inputs for s in samples), samples[:2]
    assert "no sample generations" not in r.stdout + r.stderr, r.explain()
