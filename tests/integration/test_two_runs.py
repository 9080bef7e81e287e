"""Two ``unbroken run`` at once on one machine, both on the same local head: both succeed, neither stops the head
under the other (the head is reference-counted and stopped by whichever run ends last)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from control.backends.base import reachable
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_registry

pytestmark = pytest.mark.integration
DEMO = str(ROOT / "configs" / "demo.yaml")
PORTS = {"cluster.dashboard_port": 8305, "cluster.head_port": 6419}  # this module's head, nobody else's


def test_two_runs_at_once_share_a_local_head_and_both_succeed(tmp_path: Path) -> None:
    procs = []
    for name, steps in (("first", 30), ("second", 60)):  # the first ends first: it must not stop the head
        storage = tmp_path / name
        args = [
            a for kv in tiny_overrides(storage, name=name, **PORTS, **{"train.max_steps": steps}) for a in ("--set", kv)
        ]
        out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 (closed below)
        err = open(tmp_path / f"{name}.err", "w")  # noqa: SIM115 (closed below); Prefect logs to stderr
        env = dict(os.environ, PYTHONUNBUFFERED="1", PREFECT_HOME=str(tmp_path / f"prefect-{name}"))
        cmd = [sys.executable, "-m", "unbroken", "run", DEMO, *args]
        procs.append((name, storage, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err), (out, err)))
    for name, storage, proc, files in procs:
        try:
            code = proc.wait(timeout=600)
        finally:
            for f in files:
                f.close()
        out = (tmp_path / f"{name}.out").read_text()
        assert code == 0, f"{name} exit {code}\n{out[-3000:]}\n{(tmp_path / f'{name}.err').read_text()[-5000:]}"
        assert out.strip().splitlines()[-1] == f"final model: {storage / 'runs' / name / 'final'}"
        reg = read_registry(storage, name)
        assert reg["state"] == "succeeded" and len(reg["attempts"]) == 1, reg
    assert reachable(f"http://127.0.0.1:{PORTS['cluster.dashboard_port']}") is not None, "the last run stops the head"
