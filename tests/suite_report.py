"""Where a test session's time goes: a pytest plugin (loaded by tests/conftest.py) that times every test and tier and
samples the machine's CPU, so the suite's budget is measured by the suite itself.

Each tier is a top folder of ``tests/`` (unit, integration, chaos, multinode, launcher). At the end of the session it
prints a table -- per tier: tests, wall time (first start to last end, fixtures included), and how idle the CPU was
meanwhile -- and the slowest tests, and writes under ``$UNBROKEN_TEST_REPORT`` (default ``.unbroken/test-report``):

- ``tiers.json``: the table;
- ``tests.tsv``: every test's tier, wall seconds (setup + call + teardown) and outcome;
- ``cpu.tsv``: the CPU sample (time, busy %) every ``SAMPLE_S`` seconds.

A tier table with a low CPU use is waiting, not working: the place to look for sleeps and fixed timeouts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

SAMPLE_S = 2.0
SLOWEST = 25


@dataclass
class _Session:
    started: float = field(default_factory=time.time)
    tests: dict[str, dict] = field(default_factory=dict)  # nodeid -> tier, start, end, outcome
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (time, busy %)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        psutil.cpu_percent(None)
        while not self.stop.wait(SAMPLE_S):
            self.cpu.append((time.time(), psutil.cpu_percent(None)))

    def busy_between(self, lo: float, hi: float) -> float | None:
        seen = [b for t, b in self.cpu if lo <= t <= hi]
        return round(sum(seen) / len(seen), 1) if seen else None


_S = _Session()


def tier_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def report_dir() -> Path:
    return Path(os.environ.get("UNBROKEN_TEST_REPORT") or Path(__file__).resolve().parents[1] / ".unbroken/test-report")


def pytest_sessionstart(session) -> None:
    threading.Thread(target=_S.sample, name="cpu-sample", daemon=True).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    yield
    _S.tests[item.nodeid] = _S.tests.get(item.nodeid, {}) | {"tier": tier_of(item.nodeid), "start": start,
                                                              "end": time.time()}  # fmt: skip


def pytest_runtest_logreport(report) -> None:
    entry = _S.tests.setdefault(report.nodeid, {})
    if report.failed or (report.when == "call" and not entry.get("outcome")):
        entry["outcome"] = report.outcome if report.when == "call" else f"{report.when} {report.outcome}"
    elif report.skipped:
        entry["outcome"] = "skipped"


def tiers() -> list[dict]:
    """Per tier, in the order the tiers ran: tests, wall seconds, summed test seconds, mean CPU busy %."""
    out: dict[str, dict] = {}
    for t in sorted((t for t in _S.tests.values() if "start" in t), key=lambda t: t["start"]):
        row = out.setdefault(t["tier"], {"tier": t["tier"], "tests": 0, "start": t["start"], "end": t["end"],
                                         "test_s": 0.0})  # fmt: skip
        row["tests"] += 1
        row["end"] = max(row["end"], t["end"])
        row["test_s"] += t["end"] - t["start"]
    for row in out.values():
        row["wall_s"] = round(row["end"] - row["start"], 1)
        row["test_s"] = round(row["test_s"], 1)
        row["cpu_busy_pct"] = _S.busy_between(row["start"], row["end"])
    return list(out.values())


def pytest_terminal_summary(terminalreporter) -> None:
    _S.stop.set()
    rows = tiers()
    if not rows:
        return
    tr = terminalreporter
    total = time.time() - _S.started
    tr.section("suite time by tier")
    tr.write_line(f"{'tier':<12} {'tests':>5} {'wall s':>8} {'CPU busy %':>10}")
    for r in rows:
        busy = "-" if r["cpu_busy_pct"] is None else f"{r['cpu_busy_pct']:.0f}"
        tr.write_line(f"{r['tier']:<12} {r['tests']:>5} {r['wall_s']:>8.1f} {busy:>10}")
    tr.write_line(
        f"{'session':<12} {len(_S.tests):>5} {total:>8.1f} {_S.busy_between(_S.started, time.time()) or 0:>10.0f}"
    )
    slow = sorted(((t["end"] - t["start"], n) for n, t in _S.tests.items() if "start" in t), reverse=True)
    tr.write_line(f"slowest {min(SLOWEST, len(slow))} tests (setup + call + teardown):")
    for secs, nodeid in slow[:SLOWEST]:
        tr.write_line(f"{secs:8.1f}s  {nodeid}")
    _write(rows, total)


def _write(rows: list[dict], total: float) -> None:
    out = report_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiers.json").write_text(json.dumps({"session_s": round(total, 1), "tiers": rows}, indent=1))
    lines = ["nodeid\ttier\tseconds\toutcome"]
    lines += [f"{n}\t{t['tier']}\t{t['end'] - t['start']:.2f}\t{t.get('outcome', '')}"
              for n, t in sorted(_S.tests.items(), key=lambda x: x[1].get("start", 0)) if "start" in t]  # fmt: skip
    (out / "tests.tsv").write_text("\n".join(lines) + "\n")
    (out / "cpu.tsv").write_text("time\tbusy_pct\n" + "".join(f"{t:.1f}\t{b:.1f}\n" for t, b in _S.cpu))
