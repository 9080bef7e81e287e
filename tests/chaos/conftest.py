"""One real local Ray head (token auth on) for the whole chaos suite, one uninterrupted baseline run to compare
every broken run against, and a table of what each fault cost (printed at the end of the session)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from control.backends.base import ClusterHandle
from control.backends.local import start_local_head, stop_local_head
from ray_jobs.faults import FILE_ENV
from tests.chaos.harness import DELAY_FILE, REPORT, chaos_config


@pytest.fixture(scope="package", autouse=True)
def _prefect(shared_prefect):
    """Every ``unbroken`` process and flow here talks to the session's one Prefect server (tests/conftest.py)."""
    return shared_prefect


@pytest.fixture(scope="package")  # stopped before other packages start their own heads (one per machine)
def ray_cluster(tmp_path_factory) -> Iterator[ClusterHandle]:
    """The package's one head. Its environment names the step-delay file (harness.slow_steps), and so does every
    process that may start it again: a watchdog's, this one's."""
    os.environ[FILE_ENV] = str(DELAY_FILE)
    cfg = chaos_config(tmp_path_factory.mktemp("chaos-cluster"), "chaos-head")
    handle = start_local_head(cfg)
    assert handle.started_here, "another Ray cluster is already running on this machine"
    yield handle
    stop_local_head(handle)
    os.environ.pop(FILE_ENV, None)
    DELAY_FILE.unlink(missing_ok=True)


@pytest.fixture(scope="package")
def baseline(uninterrupted) -> str:
    """Final-weights hash of the chaos config trained without interruption (same seed, same world size)."""
    return uninterrupted[0]


def pytest_terminal_summary(terminalreporter) -> None:
    if not REPORT:
        return
    tr = terminalreporter
    tr.section("chaos: what each fault cost")
    tr.write_line(
        f"{'scenario':<34} {'detected by':<32} {'detection s':>11} {'to 1st new step s':>17} {'lost steps':>10}"
    )
    for r in REPORT:
        det = "-" if r["detection_s"] is None else f"{r['detection_s']:.1f}"
        tr.write_line(
            f"{r['scenario']:<34} {r['detected_by']:<32} {det:>11} {r['recovery_s']:>17.1f} {r['lost_steps']:>10}"
        )
