"""``make test``: the whole suite as two pytest sessions at once (lanes), each a fixed list of tiers (and files).

One session alone leaves half of this 2-core machine idle (a suite-wide CPU sample: 49 % idle), waiting on real
processes -- Ray noticing a dead node, a stall timeout, a Prefect server restarting, ``ray up`` over SSH. Two lanes
fill those waits with the other lane's work. They share nothing a test relies on: each tier starts its own Ray heads
on its own ports (or in its own network namespaces), its own Prefect server, moto server and temp folders; a test
that looks for processes looks only under its own head (tests/procs.py); the real model is built once behind a file
lock (configs/models/smollm2.py).

Each lane's output goes to ``<report>/lane-<n>/output.log`` while it runs and is printed whole when it ends; then the
tier table of both (tests/suite_report.py), where both lanes' CPU went by process (tests/cpu_by_process.py:
``<report>/processes.tsv``), and one closing line with every lane's counts. Exit status: the first
failing lane's.

    python -m tests.lanes [--report .unbroken/test-report] [--tier ci --shard auto] [PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.cpu_by_process import Sampler
from tests.cpu_by_process import report as cpu_report

ROOT = Path(__file__).resolve().parents[1]
# The heavy, mostly-waiting tiers (chaos, multinode hosts, ray up over SSH) beside the CPU-bound ones. A
# self-contained unit file (in-process, its own free ports) listed here closes lane 2 instead of lane 1, so that the
# lanes end together. None is now: a .ci/run on 2026-11-27 with the unit tier's three slowest files (~230 s) here had
# lane 1 (integration, then unit) end at 3732 s and lane 2 at 4302 s -- the chaos tier is the long pole since the
# integration tier's cuts of that day. Lane 2 in the other order (multinode and launcher first, beside the
# integration tier's two-worker jobs) was measured: its waiting tiers waited longer under that load (multinode
# 526 -> 668 s, launcher 266 -> 318 s) and it ended 130 s later.
LATE_UNIT: list[str] = []
LANES = [
    ["tests/integration", "tests/unit", *[f"--ignore={f}" for f in LATE_UNIT]],
    ["tests/chaos", "tests/multinode", "tests/launcher", *LATE_UNIT],
]
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def say_tier(extra: list[str]) -> None:
    """Which tier runs (tests/tiers.py), and for make test which shard of the full tier's own tests."""
    from tests.tiers import SHARDS, commit_shard

    args = dict(zip(extra, extra[1:], strict=False))
    tier, shard = args.get("--tier", "full"), args.get("--shard")
    if tier == "full":
        print("tier full: every test (make test-full)", flush=True)
        return
    if shard == "auto":
        k, commit = commit_shard()
        shard = f"{k}/{SHARDS} (commit {commit[:12]})"
    print(f"tier ci: make test's own tests, and the full tier's shard {shard or 'none'}", flush=True)


def run_lanes(report: Path, extra: list[str]) -> int:
    say_tier(extra)
    procs, cpu = [], Sampler().start()  # where both lanes' CPU goes (tests/cpu_by_process.py)
    for n, paths in enumerate(LANES, 1):
        out = report / f"lane-{n}"
        out.mkdir(parents=True, exist_ok=True)
        log = (out / "output.log").open("w")
        env = dict(os.environ, UNBROKEN_TEST_REPORT=str(out), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pytest", *paths, f"--junitxml={out / 'junit.xml'}", *extra]
        procs.append(
            (n, paths, out, log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        )
        print(f"lane {n}: {' '.join(paths)} -> {out / 'output.log'}", flush=True)
    started, codes, totals = time.time(), [], {}
    for n, paths, out, log, proc in procs:
        codes.append(proc.wait())
        log.close()
        text = (out / "output.log").read_text()
        print(f"\n{'=' * 30} lane {n}: {' '.join(paths)} (exit {codes[-1]}) {'=' * 30}\n{text}", flush=True)
        for count, what in COUNTS.findall(_closing_line(text)):
            key = "errors" if what.startswith("error") else what
            totals[key] = totals.get(key, 0) + int(count)
    cpu.stop()
    _tier_table(report, time.time() - started)
    cpu_report(cpu, report / "processes.tsv")
    failed = totals.get("failed", 0) + totals.get("errors", 0) + sum(1 for c in codes if c and not _closing_ok(c))
    skipped = f", {totals['skipped']} skipped" if totals.get("skipped") else ""
    print(f"{totals.get('passed', 0)} passed, {failed} failed{skipped}")  # the suite's closing line, both lanes
    return next((c for c in codes if c != 0), 0)


def _closing_ok(code: int) -> bool:
    """Whether a lane's exit code is one pytest gives with its own summary line (tests failed: 1); any other
    (interrupted, internal error, no tests collected) counts as one more failure."""
    return code == 1


def _closing_line(text: str) -> str:
    """pytest's closing summary line (``=== 12 passed, 1 failed in 3.2s ===``), or nothing."""
    lines = [ln for ln in text.splitlines() if ln.startswith("=") and " in " in ln and COUNTS.search(ln)]
    return lines[-1] if lines else ""


def _tier_table(report: Path, wall_s: float) -> None:
    rows = []
    for f in sorted(report.glob("lane-*/tiers.json")):
        rows += [dict(r, lane=f.parent.name) for r in json.loads(f.read_text())["tiers"]]
    print("\n== suite time by tier (lanes run at once) ==")
    print(f"{'tier':<12} {'lane':<7} {'tests':>5} {'wall s':>8} {'CPU busy %':>10}")
    for r in sorted(rows, key=lambda r: r["start"]):
        busy = "-" if r["cpu_busy_pct"] is None else f"{r['cpu_busy_pct']:.0f}"
        print(f"{r['tier']:<12} {r['lane']:<7} {r['tests']:>5} {r['wall_s']:>8.1f} {busy:>10}")
    print(f"{'all lanes':<20} {sum(r['tests'] for r in rows):>5} {wall_s:>8.1f}")
    (report / "tiers.json").write_text(json.dumps({"wall_s": round(wall_s, 1), "tiers": rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", type=Path, default=ROOT / ".unbroken" / "test-report")
    args, extra = ap.parse_known_args(argv)
    return run_lanes(args.report.resolve(), extra)


if __name__ == "__main__":
    sys.exit(main())
