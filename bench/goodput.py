"""Goodput under a steady fault rate: the demo trained while faults arrive on a seeded schedule, with live recovery
off, on, and on with a standby worker, side by side in one run, each beside a real ``unbroken watchdog``.

    .venv/bin/python bench/goodput.py [--cycle worker|mixed] [--every-s 60] [--steps 2500] [--modes off,on,standby]

- **uninterrupted**: ``unbroken run configs/demo.yaml`` per mode, no fault: its first-to-last-step time is the
  reference, and its final weights the ones every faulted run must end with;
- **faulted**: the same run while, from its first step on, a fault arrives every ``--every-s`` seconds, in a cycle:
  ``worker`` = kill -9 a train worker; ``mixed`` = kill -9 a worker, SIGTERM a worker, kill -9 the job's driver (the
  worker picked by a seeded draw, once the job has all its workers). A fault due while its target does not exist (a
restart in progress) waits for it.

Goodput = the uninterrupted run's first-to-last-step time / the faulted run's (the share of wall time that trains new
steps). Per fault: seconds from the fault to the first *new* committed step (a step never committed before) and the
steps lost (committed, then trained again after a resume). The runs log every step (``train.log_every_steps=1``) so
the metrics log times every commit; everything else is the demo's config, ``fault_tolerance.max_failures=-1`` (a
worker fault never ends the job: Ray Train restarts the group, or live recovery replaces the worker),
``max_restarts=1000`` (a steady fault rate, not a crash loop) and, per mode, ``fault_tolerance.live_recovery`` and
``fault_tolerance.standby_replicas`` (``standby``: one standby worker beside the demo's two) and
``fault_tolerance.run_host`` (``host``: live recovery on, the run outliving its driver).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import record  # noqa: E402
from bench.run_overhead import DEMO, VENV_BIN, Timed, driver_pid, wait_for  # noqa: E402

PORTS = {"cluster.dashboard_port": 8299, "cluster.head_port": 6399}  # not the demo's, the tests' or other benches'
CYCLES = {"worker": ["kill9-worker"], "mixed": ["kill9-worker", "sigterm-worker", "kill9-driver"]}


# mode -> (fault_tolerance.live_recovery, fault_tolerance.standby_replicas, fault_tolerance.run_host)
MODES = {"off": (False, 0, False), "on": (True, 0, False), "standby": (True, 1, False), "host": (True, 0, True)}


def sets(storage: Path, name: str, args, mode: str) -> list[str]:
    live, standby, host = MODES[mode]
    over = {"name": name, "storage": storage, "data.cache_dir": storage.parent / "node-cache",
            "train.max_steps": args.steps, "train.log_every_steps": 1, "fault_tolerance.max_failures": -1,
            "fault_tolerance.max_restarts": 1000,  # a steady fault rate is the point here, not a crash loop
            "fault_tolerance.live_recovery": str(live).lower(), "fault_tolerance.standby_replicas": standby,
            "fault_tolerance.run_host": str(host).lower(),
            "cluster.keep_running": "true", **PORTS}  # fmt: skip
    if standby:  # three workers within this 2-core machine's Ray (each still trains on one torch thread)
        over["cluster.cpus_per_worker"] = 0.5
    return [a for k, v in over.items() for a in ("--set", f"{k}={v}")]


def rows(storage: Path, run: str) -> list[dict]:
    path = storage / "runs" / run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being appended
            out.append(json.loads(line))
    return [r for r in out if "loss" in r or "eval_loss" in r]


def weights(storage: Path, run: str) -> str:
    return hashlib.sha256((storage / "runs" / run / "final" / "model.safetensors").read_bytes()).hexdigest()


def workers(run: str) -> list[int]:
    """The run's live train worker processes (their environment names the run's job)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "RayTrainWorker" in " ".join(p.info["cmdline"] or ()) and \
                    p.environ().get("UNBROKEN_SUBMISSION", "").startswith(f"unbroken-{run}-"):  # fmt: skip
                found.append(p.pid)
        except psutil.Error:
            continue
    return sorted(found)


class Faults(threading.Thread):
    """Injects the cycle's faults every ``every_s`` from the run's first step; records each one's cost."""

    def __init__(self, storage: Path, run: str, cycle: list[str], every_s: float, seed: int):
        super().__init__(daemon=True)
        self.storage, self.run_name, self.cycle, self.every_s = storage, run, cycle, every_s
        self.rng, self.done, self.log = random.Random(seed), threading.Event(), []
        self.workers = 2

    def run(self) -> None:
        wait_for("the first step", lambda: rows(self.storage, self.run_name) or self.done.is_set(), 900)
        due = time.time() + self.every_s
        k = 0
        while not self.done.wait(max(0.0, due - time.time())):
            kind = self.cycle[k % len(self.cycle)]
            target = self._pick(kind)
            if target is None:
                continue
            before = max((r["step"] for r in rows(self.storage, self.run_name)), default=0)
            if before >= self.steps_total - 5:  # too close to the end to measure a recovery
                return
            at = time.time()
            os.kill(target, signal.SIGTERM if kind.startswith("sigterm") else signal.SIGKILL)
            self.log.append({"fault": kind, "at": at, "step": before})
            k, due = k + 1, at + self.every_s

    steps_total = 10**9

    def _pick(self, kind: str) -> int | None:
        """A process to hit, waiting (0.2 s at a time) until one exists; None when the run is over."""
        while not self.done.is_set():
            if kind.endswith("driver"):
                pid = driver_pid(self.run_name)
                if pid:
                    return pid
            else:
                found = workers(self.run_name)
                if len(found) >= self.workers:  # the job whole again (a replacement started)
                    return self.rng.choice(found)
            time.sleep(0.2)
        return None

    def costs(self, workers: int) -> list[dict]:
        """Per fault: seconds to the first new committed step, the steps lost (trained again), and with live recovery
        the seconds until a step had all ``workers`` again (the replacement healed and took part)."""
        final = rows(self.storage, self.run_name)
        out = []
        for i, f in enumerate(self.log):
            after = [r for r in final if r["time"] > f["at"]]
            lost, to_new = fault_cost(after, f["at"], f["step"])
            # Live recovery: how long the survivors stepped without the lost replica (until it healed and took part)
            # -- short steps of this fault's, not the next one's (a driver kill leaves none)
            until = self.log[i + 1]["at"] if i + 1 < len(self.log) else float("inf")
            short = [r for r in after if r.get("participants", workers) < workers and r["time"] < until]
            whole = next((r for r in after if short and r["time"] > short[0]["time"]
                          and r.get("participants") == workers), None)  # fmt: skip
            out.append({"fault": f["fault"], "at_step": f["step"], "lost_steps": lost,
                        "to_new_step_s": round(to_new, 1) if to_new is not None else None,
                        "degraded_s": round(whole["time"] - f["at"], 1) if whole else None})  # fmt: skip
        return out


def fault_cost(after: list[dict], at: float, step: int) -> tuple[int, float | None]:
    """What a fault at ``at`` (the run then at ``step``) cost, from the rows committed after it: the steps trained
    again (a resume to an older step), and the seconds to the first new committed step (None: none came)."""
    new = next((r for r in after if r["step"] > step), None)
    resumed = after[0]["step"] - 1 if after else step
    return max(0, step - resumed), (new["time"] - at if new else None)


def one_run(storage: Path, name: str, args, mode: str, cycle: list[str] | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PYTHONUNBUFFERED": "1"}
    # A watchdog beside every run, faulted or not: its passes take CPU from training on a small machine alike
    dog = Timed([str(VENV_BIN / "unbroken"), "watchdog", "--storage", str(storage), "--interval", "1"], env)
    faults = Faults(storage, name, cycle or [], args.every_s, args.seed) if cycle else None
    flow = Timed([str(VENV_BIN / "unbroken"), "run", str(DEMO), *sets(storage, name, args, mode)], env)
    if faults:
        faults.steps_total, faults.workers = args.steps, 2 + MODES[mode][1]
        faults.start()
    try:
        reg_path = storage / "runs" / name / "run.json"
        wait_for("the run to finish", lambda: reg_path.exists() and json.loads(reg_path.read_text())["state"]
                 in ("succeeded", "failed", "gave-up"), 3600, 1)  # fmt: skip
    finally:
        if faults:
            faults.done.set()
        for p in (flow, dog):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
                p.proc.wait(timeout=120)
    state = json.loads(reg_path.read_text())["state"]
    if state != "succeeded":
        tails = [line for p in (flow, dog) for _, line in p.lines[-60:]]
        raise SystemExit(f"run {name} ended {state}; faults {faults.log if faults else []}:\n" + "\n".join(tails))
    final = rows(storage, name)
    return {"first": final[0]["time"], "last": final[-1]["time"], "steps": final[-1]["step"],
            "weights": weights(storage, name), "faults": faults.costs(faults.workers) if faults else [],
            "state": state}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycle", choices=sorted(CYCLES), default="worker")
    ap.add_argument("--every-s", type=float, default=60.0)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--modes", default="off,on,standby")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-goodput-") as d:
        storage = Path(d) / "storage"
        try:
            run_modes(storage, args, out)
        finally:
            from control.backends.local import stop_local_head

            stop_local_head(PORTS["cluster.dashboard_port"])  # kept up between the runs (cluster.keep_running)
    report(args, out)


def run_modes(storage: Path, args, out: dict) -> None:
    for mode in args.modes.split(","):
        straight = one_run(storage, f"straight-{mode}", args, mode, None)
        faulted = one_run(storage, f"faulted-{mode}", args, mode, CYCLES[args.cycle])
        base = straight["last"] - straight["first"]
        took = faulted["last"] - faulted["first"]
        out[mode] = {"uninterrupted_s": round(base, 1), "faulted_s": round(took, 1), "goodput": round(base / took, 3),
                         "faults": faulted["faults"], "bit_identical": faulted["weights"] == straight["weights"],
                         "state": faulted["state"]}  # fmt: skip
        print(f"live recovery {mode}: {out[mode]}", flush=True)
    if "off" in out and "on" in out:
        out["on_equals_off_bits"] = weights(storage, "straight-on") == weights(storage, "straight-off")
        out["on"]["goodput_vs_off"] = round(out["off"]["uninterrupted_s"] / out["on"]["faulted_s"], 3)


def report(args, out: dict) -> None:
    print(f"\ncycle {args.cycle} every {args.every_s:.0f}s, {args.steps} steps")
    print(f"{'mode':6}{'uninterrupted s':>17}{'faulted s':>11}{'goodput':>9}  faults (kind: s to a new step, lost)")
    for mode in [m for m in out if m in MODES]:
        r = out[mode]
        faults = "; ".join(f"{f['fault']}: {f['to_new_step_s']}s, {f['lost_steps']}" for f in r["faults"])
        print(f"{mode:6}{r['uninterrupted_s']:>17}{r['faulted_s']:>11}{r['goodput']:>9}  {faults}"
              f"{'' if r['bit_identical'] else '  (NOT bit-identical)'}")  # fmt: skip
    print("RESULT " + json.dumps(out | {"cycle": args.cycle, "every_s": args.every_s, "steps": args.steps}))
    record(
        f"goodput_{args.cycle}_{args.every_s:.0f}s",
        {m: out[m]["goodput"] for m in out if m in MODES}
        | {"bit_identical": all(out[m]["bit_identical"] for m in out if m in MODES), "steps": args.steps},
    )


if __name__ == "__main__":
    main()
