"""The suite's CPU table by process (tests/cpu_by_process.py, printed by ``make test``): what each process counts as,
and a process's CPU counted from when the sampler started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cpu_by_process import Sampler, kind

PY = "/work/.venv/bin/python3.11"


@pytest.mark.parametrize(
    ("cmdline", "name", "expected"),
    [
        (["ray::RayTrainWorker.run_train_fn"], "python", "ray::RayTrainWorker"),
        (["ray::TrainController.run"], "python", "ray::TrainController"),
        (["ray::IDLE"], "python", "ray::IDLE"),
        (["ray::hash_file()"], "python", "ray::hash_file"),
        (["ray-dashboard-JobHead-0 (/x/python -c ...)"], "python", "ray dashboard modules"),
        ([PY, "-m", "ray_jobs.job", "--spec", "s.json"], "python3.11", "-m ray_jobs.job"),
        ([PY, "-u", "-m", "pytest", "tests/unit"], "python3.11", "-m pytest"),
        ([PY, "/x/.venv/bin/prefect", "server", "start", "--port", "1"], "prefect", "prefect server"),
        ([PY, "/x/.venv/bin/unbroken", "watchdog", "--storage", "s"], "unbroken", "unbroken watchdog"),
        ([PY, "/x/ray/_private/workers/default_worker.py", "--node-ip-address=1"], "python", "default_worker.py"),
        ([PY, "/x/ray/dashboard/dashboard.py", "--host=1"], "python", "dashboard.py"),
        ([PY, "/x/ray/_private/workers/setup_worker.py", "--a"], "python", "setup_worker.py"),  # (then its actor's)
        ([PY, "-B", "-c", "from multiprocessing.forkserver import main"], "python", "python -c"),
        (["/x/ray/core/src/ray/raylet/raylet", "--node_ip_address=1"], "raylet", "raylet"),
        ([], "kworker/0:1", "kworker/0:1"),
    ],
)
def test_a_process_counts_as_what_it_runs(cmdline: list[str], name: str, expected: str) -> None:
    assert kind(cmdline, name) == expected


def test_a_process_started_while_sampling_counts_its_cpu_under_its_kind() -> None:
    """A child that burns CPU, then waits: sampled while it waits, its CPU is in the table as ``python -c``."""
    burn = "import sys\nx = 0\nfor i in range(3_000_000): x += i\nprint('burnt', flush=True)\nsys.stdin.read()"
    sampler = Sampler()  # (not started: sampled by hand, before the child starts and once it has burnt)
    sampler.sample()
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        sampler.sample()
    finally:
        child.communicate("", timeout=30)
    row = {what: (cpu, n) for what, cpu, n in sampler.table()}
    assert row["python -c"][0] >= 0.05 and row["python -c"][1] >= 1, row
