"""The GPU kit's Ray legs: the product's Ray Train path on the lent GPU -- ``ray_jobs.job.build_trainer``'s
``TorchTrainer`` (NCCL on a GPU, gloo on a CPU) over a one-node Ray cluster started here, in a process of its own (the
kit itself never imports Ray).

    python -m bench.gpu.ray_train [--size 1b|toy] [--legs ray-ddp,ray-restart,ray-live] [--out results.jsonl]

Every leg trains the kit's small model (``150m`` on a GPU) on the kit's generated documents, staged by the project's
staging, one worker per run unless said, ``train.deterministic``, a checkpoint every ``steps / 4`` steps:

- ``ray-ddp``: the uninterrupted run: tokens/s (steady), the process group's backend, the checkpoints Ray Train
  registered, its final weights' sha256;
- ``ray-restart``: the same run while its worker is killed (kill -9) after a step past the first checkpoint: Ray Train
  restarts the worker group, which resumes from the newest checkpoint: seconds from the kill to the first new
  committed step, the steps trained again, and whether the final weights are ``ray-ddp``'s bit for bit;
- ``ray-live``: ``fault_tolerance.live_recovery`` with two replicas sharing the one GPU (0.5 each; torchft's
  cross-replica group is NCCL on a GPU): kill -9 of one replica mid-run; the survivor's time to its next committed
  step, the participants and heals the metrics log shows, the steps lost -- or, where it cannot run, the error it
  raised (the leg reports, it does not fail the kit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import goodput  # noqa: E402
from bench.goodput import fault_cost  # noqa: E402
from bench.gpu import kit  # noqa: E402

LEGS = ("ray-ddp", "ray-restart", "ray-live")
STEPS = {"1b": 40, "toy": 12}  # per run; the live leg trains 5x as many (a replacement worker must start meanwhile)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.ray_train", description=__doc__)
    p.add_argument("--size", choices=sorted(kit.SIZES), default="1b")
    p.add_argument("--legs", default=",".join(LEGS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args(argv)
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    if unknown := sorted(set(legs) - set(LEGS)):
        p.error(f"unknown leg(s) {', '.join(unknown)}; legs: {', '.join(LEGS)}")
    with tempfile.TemporaryDirectory(prefix="unbroken-gpu-ray-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run(work, args.size, legs, args.out)
    return 0


def run(work: Path, size_name: str, legs: list[str], out: Path | None) -> None:
    import ray

    size = kit.SIZES[size_name]
    steps = STEPS[size_name]
    model = kit.build_model(size.small, work / f"model-{size.small}")
    # Sized for the longest run (the live leg's two replicas), so no run wraps into a second epoch.
    sized = dataclasses.replace(size, model=size.small, steps=steps * 5 * 2)
    cuda = kit.device() == "cuda"
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")  # as ray_jobs.job.main sets it
    ray.init(num_cpus=os.cpu_count(), num_gpus=1 if cuda else 0, include_dashboard=False,
             _temp_dir=str(Path(tempfile.gettempdir()) / "unbroken-gpu-ray"))  # fmt: skip
    started = time.monotonic()
    try:
        straight = None
        if "ray-ddp" in legs or "ray-restart" in legs:
            straight = leg_ddp(work, sized, model, steps)
            kit.emit(straight, out)
        if "ray-restart" in legs:
            kit.emit(leg_restart(work, sized, model, steps, straight), out)
        if "ray-live" in legs:
            kit.emit(leg_live(work, sized, model, steps * 5), out)
    finally:
        ray.shutdown()
    kit.emit({"leg": "ray-env", "ray": ray.__version__, "device": kit.leg_env()["device"],
              "wall_s": round(time.monotonic() - started, 1)}, out)  # fmt: skip


def run_config(work: Path, size: kit.Size, model: Path, name: str, steps: int, **extra: Any):
    return kit.config(work, name, model, size, **{"train.max_steps": steps, "checkpoint.every_steps": steps // 4,
                      "train.deterministic": True, "fault_tolerance.max_failures": 3, **extra})  # fmt: skip


def fit(cfg) -> tuple[Any, float]:
    """The product's TorchTrainer for ``cfg`` (the flow's preparation made without Prefect), fitted here."""
    from ray_jobs.job import build_trainer
    from ray_jobs.local import prepare

    trainer = build_trainer(cfg, prepare(cfg).set(group=time.time_ns()))
    t0 = time.monotonic()
    result = trainer.fit()
    return result, time.monotonic() - t0


def leg_ddp(work: Path, size: kit.Size, model: Path, steps: int) -> dict[str, Any]:
    cfg = run_config(work, size, model, "ray-ddp", steps)
    result, wall = fit(cfg)
    got = rows(cfg)
    tps, timed = kit.tokens_per_s(got, size.warm)
    return {"leg": "ray-ddp", "model": size.small, "workers": 1, "backend": "nccl" if cfg.cluster.use_gpu else "gloo",
            "steps": max(r["step"] for r in got), "steps_timed": timed, "tokens_per_s": round(tps, 1),
            "ray_checkpoint": bool(result.checkpoint), "checkpoints_kept": len(checkpoints(cfg)),
            "fit_s": round(wall, 1), "final_sha256": final_sha(cfg)}  # fmt: skip


def leg_restart(work: Path, size: kit.Size, model: Path, steps: int, straight: dict | None) -> dict[str, Any]:
    cfg = run_config(work, size, model, "ray-restart", steps)
    killer = Killer(cfg, at_step=steps // 4 + 2, replicas=1)
    killer.start()
    result, wall = fit(cfg)
    killer.join(timeout=5)
    line = {"leg": "ray-restart", "model": size.small, "steps": steps, "fit_s": round(wall, 1), **killer.costs()}
    line["final_sha256"] = final_sha(cfg)
    line["bit_identical_to_ray_ddp"] = straight is not None and line["final_sha256"] == straight["final_sha256"]
    return line


def leg_live(work: Path, size: kit.Size, model: Path, steps: int) -> dict[str, Any]:
    """Two replicas on the one GPU: the product's scaling gives each worker a whole GPU, so this leg asks Ray for
    half of one per worker (the only change to the product's path)."""
    from ray.train import ScalingConfig

    import ray_jobs.job as job

    cfg = run_config(work, size, model, "ray-live", steps, **{"cluster.num_workers": 2,
                     "fault_tolerance.live_recovery": True, "fault_tolerance.max_failures": 2,
                     "data.min_shards": 2})  # fmt: skip
    own = job.scaling_config
    if cfg.cluster.use_gpu:
        cpus = cfg.cluster.cpus_per_worker / 2
        job.scaling_config = lambda c: ScalingConfig(num_workers=2, use_gpu=True,
                                                     resources_per_worker={"CPU": cpus, "GPU": 0.5})  # fmt: skip
    killer = Killer(cfg, at_step=steps // 5, replicas=2)
    killer.start()
    line: dict[str, Any] = {"leg": "ray-live", "model": size.small, "replicas": 2, "steps": steps}
    try:
        _, wall = fit(cfg)
        line |= {"ok": True, "fit_s": round(wall, 1)}
    except Exception as e:  # noqa: BLE001 -- reported: what torchft's path did on this device is the finding
        line |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}", "trace": traceback.format_exc()[-3000:]}
    finally:
        job.scaling_config = own
        killer.done = True
        killer.join(timeout=5)
    got = rows(cfg)
    line |= killer.costs() | {"last_step": max((r["step"] for r in got), default=0),
                              "participants_seen": sorted({r.get("participants") for r in got} - {None}),
                              "heals": max((r.get("heals", 0) for r in got), default=0)}  # fmt: skip
    return line


class Killer:
    """kill -9 of a train worker once the run has committed ``at_step`` (with ``replicas`` workers up)."""

    def __init__(self, cfg, at_step: int, replicas: int):
        import threading

        self.cfg, self.at_step, self.replicas, self.done = cfg, at_step, replicas, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.fault: dict[str, Any] | None = None

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.done = True
        self.thread.join(timeout)

    def _run(self) -> None:
        while not self.done:
            got = rows(self.cfg)
            step = max((r["step"] for r in got), default=0)
            pids = train_workers()
            if step >= self.at_step and len(pids) >= self.replicas:
                at = time.time()
                os.kill(pids[-1], signal.SIGKILL)
                self.fault = {"at": at, "step": step}
                return
            time.sleep(0.02)

    def costs(self) -> dict[str, Any]:
        if self.fault is None:
            return {"killed": False}
        at, step = self.fault["at"], self.fault["step"]
        lost, to_new = fault_cost([r for r in rows(self.cfg) if r["time"] > at], at, step)
        return {"killed": True, "killed_after_step": step, "lost_steps": lost,
                "to_new_step_s": round(to_new, 2) if to_new is not None else None}  # fmt: skip


def train_workers() -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "RayTrainWorker" in " ".join(p.info["cmdline"] or ()):
                found.append(p.pid)
    return sorted(found)


def rows(cfg) -> list[dict[str, Any]]:
    """The run's committed training steps from its metrics log (bench/goodput.py reads it)."""
    return [r for r in goodput.rows(Path(cfg.storage), cfg.name) if "loss" in r]


def checkpoints(cfg) -> list[str]:
    from ray_jobs import checkpoint as ckpt
    from ray_jobs.storage import Layout

    return [url for _, url in ckpt.list_checkpoints(Layout(cfg.storage).checkpoints_dir(cfg.name))]


def final_sha(cfg) -> str:
    return goodput.weights(Path(cfg.storage), cfg.name)


if __name__ == "__main__":
    sys.exit(main())
