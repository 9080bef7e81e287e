"""What experiment trackers cost a training step: the same in-process run of the demo model with no tracker, with
TensorBoard + MLflow (SQLite) + W&B (offline) on, and with trackers that fail (an MLflow server that accepts the
connection and never answers -- a hang -- and one where nothing listens -- refused).

    .venv/bin/python bench/tracking_overhead.py [--steps 300] [--repeats 3]

Each run is ``ray_jobs.local.train`` in a fresh process (the loop Ray Train runs, one CPU rank, no Ray), the demo
config at ``train.log_every_steps=1`` (every step feeds every tracker: the most tracker traffic a run can make),
no eval and no checkpoint inside the measured window. The time per step is read from the metrics log's row times
(the last logged step's time minus the 20th's, over the steps between), so model loading, staging, tracker opening
and export are outside it. Variants run interleaved, ``--repeats`` times each; the median is reported with its ratio
to no tracker. Also reported: how long the run waited for its trackers at the end (their close), and the warnings
the failing trackers logged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO = ROOT / "configs" / "demo.yaml"
SKIP = 20  # the first steps (warm-up, the trackers opening) are left out of the timing


def silent_server() -> tuple[int, threading.Event]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a hung tracking server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        srv.settimeout(0.5)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue
        for s in held:
            s.close()
        srv.close()

    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1], stop


def variants(hang_port: int) -> dict[str, list[str]]:
    return {
        "none": [],
        "tb+mlflow+wandb": ["tracking.tensorboard=true", "tracking.mlflow=true", "tracking.wandb=true"],
        "mlflow hangs": ["tracking.tensorboard=true", f"tracking.mlflow.tracking_uri=http://127.0.0.1:{hang_port}"],
        "mlflow refused": ["tracking.tensorboard=true", "tracking.mlflow.tracking_uri=http://127.0.0.1:9"],
    }


def one_run(root: Path, name: str, steps: int, extra: list[str]) -> dict:
    storage = root / "storage"
    sets = [f"storage={storage}", f"name={name}", f"data.cache_dir={root / 'node-cache'}", f"train.max_steps={steps}",
            "train.log_every_steps=1", f"train.eval_every_steps={steps}", f"checkpoint.every_steps={steps}", *extra]  # fmt: skip
    args = [sys.executable, "-m", "unbroken", "train", "--local", str(DEMO)]
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="600",
               OMP_NUM_THREADS="1")  # fmt: skip
    started = time.time()
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (storage / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows if "time" in r}
    last = max(times)
    per_step = (times[last] - times[SKIP]) / (last - SKIP)
    out = done.stdout + done.stderr
    return {"s_per_step": per_step, "after_last_step_s": ended - times[last], "total_s": ended - started,
            "warnings": re.findall(r"tracker \w+ (?:failed to \w+|did not finish)[^\n]*", out)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    port, stop = silent_server()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tracking-bench-") as tmp:
        root = Path(tmp)
        one_run(root, "warm", SKIP + 5, [])  # the base model and the dataset, once (cache hits afterwards)
        for i in range(args.repeats):
            for label, extra in variants(port).items():
                name = f"{re.sub(r'[^a-z]+', '-', label)}-{i}"
                r = one_run(root, name, args.steps, extra)
                results.setdefault(label, []).append(r)
                print(f"{label:16s} run {i}: {r['s_per_step'] * 1000:7.2f} ms/step, {r['after_last_step_s']:5.1f} s "
                      f"after the last step", flush=True)  # fmt: skip
    stop.set()
    base = statistics.median(r["s_per_step"] for r in results["none"])
    print(f"\n{'variant':16s} {'ms/step (median)':>17s} {'ratio':>6s} {'end wait s':>10s}  warnings")
    for label, runs in results.items():
        ms = statistics.median(r["s_per_step"] for r in runs)
        wait = statistics.median(r["after_last_step_s"] for r in runs)
        warned = sorted({w.split(" (")[0] for r in runs for w in r["warnings"]})
        print(f"{label:16s} {ms * 1000:17.2f} {ms / base:6.3f} {wait:10.1f}  {'; '.join(warned) or '-'}")


if __name__ == "__main__":
    main()
