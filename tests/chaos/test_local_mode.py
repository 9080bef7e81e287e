"""Local mode (``unbroken train CONFIG --local`` under ``torchrun``) and Ray Train share one checkpoint format: a run
killed under torchrun resumes on Ray, one stopped on Ray resumes under torchrun, and both end bit-identical to the
session's uninterrupted run of the same config (same seed, same world size)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from control.backends.base import jobs_client
from ray_jobs import checkpoint as ckpt
from ray_jobs.storage import Layout
from tests.chaos.harness import chaos_config, final_weights_hash, start_run, wait_job
from tests.conftest import ROOT
from tests.procs import wait_for

# The kill and the stop again, across the two runtimes (their one checkpoint format: tests/unit/test_local_mode.py)
pytestmark = [pytest.mark.chaos, pytest.mark.full(shard=1)]

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SLOW = {"UNBROKEN_INJECT_DELAY": "step:0.1"}  # ~24 s for the run's 240 steps: time to kill it after a checkpoint


def local_train(cfg, tmp_path: Path, env: dict | None = None) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m unbroken train <cfg as YAML>``."""
    path = tmp_path / f"{cfg.name}.yaml"
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "unbroken", "train", str(path)]  # local: implied
    out = (tmp_path / f"{cfg.name}.log").open("w")
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)


def newest_checkpoint_step(cfg) -> int:
    found = ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(cfg.name))
    return ckpt.checkpoint_step(found[0]) if found else 0


def test_killed_under_torchrun_resumes_on_ray_and_stopped_on_ray_resumes_under_torchrun(
    ray_cluster, baseline, tmp_path
):
    # torchrun -> kill -9 (the whole process group: torchrun and both ranks) -> Ray
    a = chaos_config(tmp_path / "a", "torchrun-then-ray")
    p = local_train(a, tmp_path, SLOW)
    try:
        wait_for("a checkpoint under torchrun", lambda: newest_checkpoint_step(a) > 0 or p.poll() is not None,
                 timeout_s=180, every_s=0.2)  # fmt: skip
        assert p.poll() is None, (tmp_path / f"{a.name}.log").read_text()[-3000:]
    finally:  # torchrun starts each rank in a session of its own: kill -9 the agent and every rank it started
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
    stopped_at = newest_checkpoint_step(a)
    assert 0 < stopped_at < a.train.max_steps
    sid = start_run(ray_cluster, a)
    assert wait_job(ray_cluster, sid) == "SUCCEEDED"
    resumed = re.findall(r"rank 0: resumed from \S+ at step (\d+)", jobs_client(ray_cluster.address).get_job_logs(sid))
    assert resumed == [str(stopped_at)], "resumed on Ray where torchrun was killed"
    assert final_weights_hash(a) == baseline, "torchrun killed, resumed on Ray: bit-identical to the uninterrupted run"

    # Ray -> stopped (ray job stop) -> torchrun
    b = chaos_config(tmp_path / "b", "ray-then-torchrun")
    sid = start_run(ray_cluster, b, env=SLOW)
    wait_for("a checkpoint on Ray", lambda: newest_checkpoint_step(b) > 0, timeout_s=180, every_s=0.2)
    jobs_client(ray_cluster.address).stop_job(sid)
    assert wait_job(ray_cluster, sid) == "STOPPED"
    stopped_at = newest_checkpoint_step(b)
    assert 0 < stopped_at < b.train.max_steps
    p = local_train(b, tmp_path)
    assert p.wait(timeout=300) == 0, (tmp_path / f"{b.name}.log").read_text()[-3000:]
    log = (tmp_path / f"{b.name}.log").read_text()
    assert re.findall(r"rank 0: resumed from \S+ at step (\d+)", log) == [str(stopped_at)]
    assert f"final model: {Layout(b.storage).final_model(b.name)}" in log
    assert final_weights_hash(b) == baseline, "stopped on Ray, resumed under torchrun: bit-identical"
