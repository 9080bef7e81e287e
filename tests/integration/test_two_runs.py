"""Two ``unbroken run`` at once on one machine, both on the same local head, and both called ``twin`` (two projects
naming their runs alike, each in its own storage): both succeed, each with its own job (the submission id names the
storage too), neither watches, adopts or stops the other's job, and neither stops the head under the other (the head
is reference-counted by run and storage, and stopped by whichever run ends last)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from control import registry
from control.backends.base import reachable
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_registry

pytestmark = [pytest.mark.integration, pytest.mark.full(shard=1)]
DEMO = str(ROOT / "configs" / "demo.yaml")
PORTS = {"cluster.dashboard_port": 8305, "cluster.head_port": 6419}  # this module's head, nobody else's


def test_two_runs_of_one_name_in_two_storages_at_once_share_a_local_head_and_each_trains_its_own_job(
    tmp_path: Path,
) -> None:
    """A watchdog watches each storage meanwhile (each run's team runs its own): neither takes the other run's job
    for its run's, nor restarts, adopts or stops anything."""
    dogs = []
    for project in ("project-a", "project-b"):
        storage = tmp_path / project / "storage"
        log = open(tmp_path / f"watchdog-{project}.log", "w")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, "-m", "unbroken", "watchdog", "--storage", str(storage), "--interval", "3"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        dogs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        _two_runs(tmp_path)
    finally:
        for proc, log in dogs:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()
    for project in ("project-a", "project-b"):
        said = (tmp_path / f"watchdog-{project}.log").read_text()
        assert "twin: ok" in said, said[-3000:]  # it watched the run while it trained
        assert not [w for w in ("restarted", "stopped", "adopt", "gave-up") if f"twin: {w}" in said], said[-3000:]


def _two_runs(tmp_path: Path) -> None:
    procs = []
    for project, steps in (("project-a", 30), ("project-b", 60)):  # a ends first: it must not stop the head
        storage = tmp_path / project / "storage"
        sets = tiny_overrides(storage, name="twin", **PORTS, **{"train.max_steps": steps})
        out = open(tmp_path / f"{project}.out", "w")  # noqa: SIM115 (closed below)
        err = open(tmp_path / f"{project}.err", "w")  # noqa: SIM115 (closed below); Prefect logs to stderr
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "unbroken", "run", DEMO, *(a for kv in sets for a in ("--set", kv))]
        procs.append((project, storage, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err), (out, err)))
    sids = []
    for project, storage, proc, files in procs:
        try:
            code = proc.wait(timeout=600)
        finally:
            for f in files:
                f.close()
        out, err = ((tmp_path / f"{project}.{x}").read_text() for x in ("out", "err"))
        assert code == 0, f"{project} exit {code}\n{out[-3000:]}\n{err[-5000:]}"
        assert out.strip().splitlines()[-1] == f"final model: {storage / 'runs' / 'twin' / 'final'}"
        reg = read_registry(storage, "twin")
        assert reg["state"] == "succeeded" and len(reg["attempts"]) == 1, reg
        sids.append(reg["attempts"][0]["submission_id"])
        assert sids[-1] == registry.submission_id(reg["config"]["storage"], "twin", 1), "its own job"
        assert (storage / "runs" / "twin" / "final" / "model.safetensors").exists()
    assert sids[0] != sids[1], sids
    assert reachable(f"http://127.0.0.1:{PORTS['cluster.dashboard_port']}") is not None, "the last run stops the head"
