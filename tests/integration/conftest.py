"""Helpers for runs of the real CLI: a real local Ray cluster and a real Prefect server (the session's shared one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

UNBROKEN = [sys.executable, "-m", "unbroken"]


@pytest.fixture(scope="package", autouse=True)
def _prefect(shared_prefect):
    """Every ``unbroken`` process and flow here talks to the session's one Prefect server (tests/conftest.py)."""
    return shared_prefect


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout (tail)\n{self.stdout[-4000:]}\n--- stderr (tail)\n{self.stderr[-4000:]}"


def run_cli(*args: str, timeout: float = 600) -> CliRun:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([*UNBROKEN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return CliRun(p.returncode, p.stdout, p.stderr)


def read_registry(storage: Path, run: str) -> dict:
    return json.loads((storage / "runs" / run / "run.json").read_text())


def read_metrics(storage: Path, run: str) -> list[dict]:
    return [json.loads(x) for x in (storage / "runs" / run / "metrics.jsonl").read_text().splitlines()]
