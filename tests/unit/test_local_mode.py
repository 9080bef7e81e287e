"""Local mode (ray_jobs/local.py, ``unbroken train CONFIG --local``): what needs Ray is refused before anything is
prepared, naming the field; a run trains in this process to the same final folder, and a second start resumes it.
(torchrun <-> Ray resumes, bit-identical: tests/chaos/test_local_mode.py.)"""

from __future__ import annotations

import pytest

from ray_jobs.config import ConfigError, load_config
from ray_jobs.local import check_local, local_problems
from ray_jobs.storage import Layout, exists, join
from tests.conftest import ROOT, tiny_overrides
from unbroken.cli import main

DEMO = ROOT / "configs" / "demo.yaml"


def cfg_of(tmp_path, **extra):
    return load_config(DEMO, tiny_overrides(tmp_path / "storage", **extra))


def test_what_needs_ray_is_named(tmp_path):
    assert local_problems(cfg_of(tmp_path), 2, 2, 0) == []
    assert local_problems(cfg_of(tmp_path), 1, 1, 0) == []  # one process for a 2-worker layout: 2 micro-batches each
    elastic = local_problems(cfg_of(tmp_path, **{"cluster.num_workers": "{min: 1, max: 2}"}), 2, 2, 0)
    assert len(elastic) == 1 and elastic[0].startswith("cluster.num_workers: elastic")
    nodes = local_problems(cfg_of(tmp_path), 2, 1, 0)
    assert len(nodes) == 1 and "one machine" in nodes[0]
    odd = local_problems(cfg_of(tmp_path, **{"cluster.num_workers": 4}), 3, 3, 0)
    assert len(odd) == 1 and odd[0].startswith("cluster.num_workers: the data is laid out for 4 workers")
    gpu = local_problems(cfg_of(tmp_path, **{"cluster.use_gpu": True}), 2, 2, 1)
    assert len(gpu) == 1 and gpu[0].startswith("cluster.use_gpu:")
    live = local_problems(cfg_of(tmp_path, **{"fault_tolerance.live_recovery": True}), 2, 2, 0)
    assert len(live) == 1 and live[0].startswith("fault_tolerance.live_recovery: needs Ray Train")
    warm = local_problems(cfg_of(tmp_path, **{"model.init_from": "series-champion"}), 1, 1, 0)
    assert len(warm) == 1 and warm[0].startswith("model.init_from:")
    with pytest.raises(ConfigError, match="cluster.use_gpu"):  # this machine has no CUDA device
        check_local(cfg_of(tmp_path, **{"cluster.use_gpu": True}))


def test_unbroken_train_trains_here_and_a_second_start_resumes(tmp_path, capsys, caplog):
    caplog.set_level("INFO")
    args = ["train", str(DEMO)]  # its only mode: no --local needed
    for o in tiny_overrides(tmp_path / "storage", **{"train.max_steps": 6, "checkpoint.every_steps": 3,
                                                     "train.eval_every_steps": 3}):  # fmt: skip
        args += ["--set", o]
    assert main(args) == 0
    cfg = cfg_of(tmp_path)
    final = Layout(cfg.storage).final_model(cfg.name)
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"final model: {final}"
    assert exists(join(final, "model.safetensors")) and exists(join(final, "tokenizer.json"))
    assert main([*args, "--local"]) == 0  # (accepted) nothing left to train: resumes at step 6 and exports again
    assert "rank 0: resumed from" in caplog.text and "at step 6 (" in caplog.text


def test_unbroken_train_on_an_elastic_config_is_one_clear_error(tmp_path, capsys):
    elastic = ["--set", "cluster.num_workers={min: 1, max: 2}", "--set", f"storage={tmp_path}"]
    assert main(["train", str(DEMO), "--local", *elastic]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid config") and "cluster.num_workers: elastic" in err
    assert not (tmp_path / "datasets").exists(), "refused before anything was prepared"
