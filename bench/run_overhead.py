"""Time outside the training loop: ``unbroken run`` vs a plain ``torchrun`` of the same trainer, and the watchdog's
restart after the job's driver is killed.

    .venv/bin/python bench/run_overhead.py [--steps 200] [--every 100] [--restart-steps 400]

All in one run, on the demo model and data (configs/demo.yaml), the same steps, seed and checkpoints:

- **torchrun**: ``torchrun --nproc-per-node 2 -m ray_jobs.local --spec <job spec>``, two gloo processes running the
  project's own training loop (``ray_jobs.local``) on the same staged shards and base model -- no Ray, no Prefect;
- **unbroken run, cold**: a fresh storage: the base model is built, the data staged, a local Ray head started;
- **unbroken run, warm**: the same storage again with another learning rate (a new recipe, so it trains): the model
  and the dataset are cache hits, a head is started again.

For each: process start -> first training step (the heartbeat's ``first_step_at``), last step (the metrics log's
last row) -> process exit, and for ``unbroken run`` also process start -> the flow run's start (Prefect's temporary
server booting, as for a user without ``PREFECT_API_URL``). Overhead = (first step - start) + (exit - last step),
reported from the process start and from the flow start; the ratio is unbroken's over torchrun's.

Then the watchdog: an ``unbroken run`` of ``--restart-steps`` steps, an ``unbroken watchdog --interval 1`` beside
it; once a checkpoint exists the Ray job's driver is killed (SIGKILL), and the time from the kill to the restarted
attempt's first step is reported, with what the watchdog recorded (detection, lost steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import record  # noqa: E402

DEMO = ROOT / "configs" / "demo.yaml"
VENV_BIN = Path(sys.executable).parent
PORTS = {"cluster.dashboard_port": 8297, "cluster.head_port": 6397}  # not the demo's: a demo may run meanwhile


def overrides(storage: Path, name: str, args, **extra) -> list[str]:
    base = {"name": name, "storage": storage, "data.cache_dir": storage.parent / "node-cache",
            "train.max_steps": args.steps, "checkpoint.every_steps": args.every, **PORTS, **extra}  # fmt: skip
    return [f"{k}={v}" for k, v in base.items()]


class Timed:
    """A subprocess whose output lines are stamped with their arrival time (kept in ``lines``)."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.start = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def wait(self, timeout_s: float = 1800) -> float:
        code = self.proc.wait(timeout=timeout_s)
        end = time.time()
        self._reader.join(timeout=10)
        if code != 0:
            tail = "\n".join(line for _, line in self.lines[-40:])
            raise SystemExit(f"{' '.join(self.proc.args[:4])}... exited {code}:\n{tail}")
        return end

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)


def loop_times(storage: Path, run: str) -> tuple[float, float, int]:
    """(first step done, last step done, steps) as the run itself recorded them."""
    beat = json.loads((storage / "runs" / run / "heartbeat.json").read_text())
    rows = [json.loads(x) for x in (storage / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return beat["first_step_at"], rows[-1]["time"], rows[-1]["step"]


# Where ``unbroken run``'s time before the first step goes: each mark is the first output line that says it (a Ray
# line by its own timestamp, when it has one; the rest as the flow's watch relays it, up to a second late).
MARKS = (
    ("the CLI: imports, config, checks", "Starting temporary server"),
    ("Prefect's temporary server boots", "Beginning flow run"),
    ("the flow's tasks: model, data, cluster, fit, record", "submitted Ray job"),
    ("Ray Jobs: runtime env, the driver starts", "Connected to Ray cluster"),
)
WORKERS_UP = "Ray Train: controller, worker group, until rank 0's loop starts"
FIRST_STEP = "the workers: model, data, resume, to the first step"
RAY_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\s")


class Loading:
    """When rank 0's training function started (the heartbeat's phase ``loading``, by its own clock): polled from the
    run's heartbeat while ``unbroken run`` runs (the phase is overwritten once training starts)."""

    def __init__(self, storage: Path, run: str):
        self.beat, self.at = storage / "runs" / run / "heartbeat.json", None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while self.at is None and not self._stop.wait(0.05):
            with contextlib.suppress(OSError, ValueError):
                beat = json.loads(self.beat.read_text())
                if beat.get("phase") == "loading":
                    self.at = beat["phase_started_at"]

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.at


def breakdown(p: Timed, loading: float | None, first_step: float) -> dict[str, float]:
    """Seconds from the process start to the first step, segment by segment (:data:`MARKS`, then rank 0's training
    function starting, then its first step)."""
    out, before = {}, p.start
    for what, needle in MARKS:
        line = next(((t, ln) for t, ln in p.lines if needle in ln), None)
        if line is None:
            continue
        said = RAY_TIME.search(line[1])
        at = (
            time.mktime(time.strptime(said.group(1), "%Y-%m-%d %H:%M:%S")) + int(said.group(2)) / 1000
            if said
            else line[0]
        )
        out[what] = round(at - before, 2)
        before = at
    if loading is not None:
        out[WORKERS_UP], before = round(loading - before, 2), loading
    out[FIRST_STEP] = round(first_step - before, 2)
    return out


def unbroken_run(storage: Path, name: str, args, **extra) -> dict:
    sets = [a for kv in overrides(storage, name, args, **extra) for a in ("--set", kv)]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # a user's first run: no Prefect server
    p = Timed([str(VENV_BIN / "unbroken"), "run", str(DEMO), *sets], env | {"PYTHONUNBUFFERED": "1"})
    loading = Loading(storage, name)
    end = p.wait()
    first, last, steps = loop_times(storage, name)
    flow = p.first("Beginning flow run")
    return {"start": p.start, "flow_start": flow, "first_step": first, "last_step": last, "exit": end,
            "steps": steps, "before_first_step": breakdown(p, loading.stop(), first)}  # fmt: skip


def torchrun(storage: Path, args) -> dict:
    """The same training as two plain torch.distributed processes (ray_jobs.local), on what unbroken staged."""
    from control.jobs import write_job_spec
    from ray_jobs.config import load_config
    from ray_jobs.contracts.job_spec import AttemptInputs
    from tasks.model import prepare_base_model
    from tasks.stage import stage_dataset

    cfg = load_config(DEMO, overrides(storage, "bench-torchrun", args))
    model = prepare_base_model.fn(cfg)
    staged = stage_dataset.fn(cfg, model)
    spec = write_job_spec(cfg, 1, AttemptInputs(manifest_url=staged.manifest_url, model_path=model))
    p = Timed([str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "-m", "ray_jobs.local", "--spec", spec],
              dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))  # fmt: skip
    end = p.wait()
    first, last, steps = loop_times(storage, cfg.name)
    return {"start": p.start, "flow_start": None, "first_step": first, "last_step": last, "exit": end, "steps": steps}


def phases(t: dict) -> dict:
    before, after = t["first_step"] - t["start"], t["exit"] - t["last_step"]
    out = {"steps": t["steps"], "start_to_first_step_s": before, "last_step_to_exit_s": after,
           "loop_s": t["last_step"] - t["first_step"], "overhead_s": before + after}  # fmt: skip
    if t["flow_start"] is not None:
        out["start_to_flow_s"] = t["flow_start"] - t["start"]
        out["flow_to_first_step_s"] = t["first_step"] - t["flow_start"]
        out["overhead_from_flow_s"] = out["flow_to_first_step_s"] + after
    rounded = {k: round(v, 2) for k, v in out.items()}
    return rounded | ({"before_first_step": t["before_first_step"]} if "before_first_step" in t else {})


def driver_pid(run: str) -> int | None:
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if "-m ray_jobs.job" in cmd and f"/runs/{run}/job-spec-" in cmd and not cmd.startswith("/bin/sh"):
            return p.pid
    return None


def wait_for(what: str, predicate, timeout_s: float = 600, every_s: float = 0.05):
    from ray_jobs.poll import poll_until

    value = poll_until(predicate, timeout_s, every_s)
    if not value:
        raise SystemExit(f"timed out waiting for {what}")
    return value


def watchdog_restart(storage: Path, args) -> dict:
    """Kill -9 the training job's driver mid-run; the watchdog (a pass a second) restarts the run from its newest
    checkpoint. Fault -> the new attempt's first step, and the incident as the watchdog recorded it."""
    from ray_jobs import checkpoint as ckpt

    run = "bench-restart"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PYTHONUNBUFFERED": "1"}
    dog = Timed([str(VENV_BIN / "unbroken"), "watchdog", "--storage", str(storage), "--interval", "1"], env)
    wait_for("the watchdog's first pass", lambda: dog.first("watchdog pass") or dog.first("Finished in state"), 180)
    # without a run host: a driver's death ends the job, which is what this restart times (with one: bench/goodput.py)
    over = {"train.max_steps": args.restart_steps, "fault_tolerance.run_host": "false"}
    sets = [a for kv in overrides(storage, run, args, **over) for a in ("--set", kv)]
    flow = Timed([str(VENV_BIN / "unbroken"), "run", str(DEMO), *sets], env)
    try:
        wait_for("a checkpoint", lambda: ckpt.find_latest_valid(str(storage / "ray" / run)), 600)
        pid = wait_for("the job's driver", lambda: driver_pid(run), 60)
        fault_at = time.time()
        os.kill(pid, signal.SIGKILL)

        def new_step():
            beat = json.loads((storage / "runs" / run / "heartbeat.json").read_text())
            return beat if beat.get("attempt", 1) > 1 and beat.get("first_step_at") else None

        beat = wait_for("the restarted attempt's first step", new_step, 600, 0.2)
        reg = wait_for("the run to finish", lambda: (r := json.loads((storage / "runs" / run / "run.json")
                                                                     .read_text()))["state"] == "succeeded" and r, 900, 1)  # fmt: skip
    finally:
        for p in (flow, dog):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
                p.proc.wait(timeout=60)
    incident = reg["incidents"][0]
    return {"fault_to_first_new_step_s": round(beat["first_step_at"] - fault_at, 2),
            "detection_s": round(incident["detected_at"] - fault_at, 2), "kind": incident["kind"],
            "lost_steps": incident["lost_steps"], "restarts": reg["restarts"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=100, help="checkpoint every N steps")
    ap.add_argument("--restart-steps", type=int, default=400)
    ap.add_argument("--skip-restart", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-overhead-") as d:
        storage = Path(d) / "storage"
        rows = {"unbroken run (cold)": phases(unbroken_run(storage, "bench-cold", args))}
        rows["unbroken run (warm)"] = phases(unbroken_run(storage, "bench-warm", args, **{"train.lr": 2.9e-3}))
        rows["torchrun"] = phases(torchrun(storage, args))
        restart = None if args.skip_restart else watchdog_restart(storage, args)
    keys = ["steps", "start_to_flow_s", "flow_to_first_step_s", "start_to_first_step_s", "loop_s",
            "last_step_to_exit_s", "overhead_from_flow_s", "overhead_s"]  # fmt: skip
    print(f"\n{'':26}" + "".join(f"{k:>22}" for k in rows))
    for k in keys:
        print(f"{k:26}" + "".join(f"{str(r.get(k, '-')):>22}" for r in rows.values()))
    base = rows["torchrun"]["overhead_s"]
    for name in ("unbroken run (cold)", "unbroken run (warm)"):
        r = rows[name]
        print(f"{name}: overhead {r['overhead_s']} s from process start ({r['overhead_s'] / base:.1f}x torchrun's "
              f"{base} s), {r['overhead_from_flow_s']} s from the flow's start")  # fmt: skip
    for name in ("unbroken run (cold)", "unbroken run (warm)"):
        print(f"{name}, process start -> first step, by segment:")
        for what, secs in rows[name]["before_first_step"].items():
            print(f"  {secs:6.2f} s  {what}")
    if restart:
        print(f"watchdog restart after kill -9 of the job driver: {restart}")
    print("RESULT " + json.dumps({"runs": rows, "restart": restart}))
    warm = rows["unbroken run (warm)"]
    record("run_overhead", {"warm_from_flow_s": warm["overhead_from_flow_s"], "warm_s": warm["overhead_s"],
                            "torchrun_s": base, "restart": restart})  # fmt: skip


if __name__ == "__main__":
    main()
