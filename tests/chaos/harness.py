"""Run training jobs on a real local Ray cluster without Prefect, and break them with real signals."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ray_jobs.config import Config, load_config
from ray_jobs.storage import Layout
from tasks.cluster import ClusterHandle, jobs_client
from tasks.jobs import submit, write_job_spec
from tasks.model import prepare_base_model
from tasks.registry import submission_id
from tasks.stage import stage_dataset
from tests.conftest import ROOT, tiny_overrides

DEMO = ROOT / "configs" / "demo.yaml"


def chaos_config(storage: Path, name: str, **extra: object) -> Config:
    """A tiny run long enough (~10 s of steps) to be interrupted mid-way."""
    base = {
        "name": name,
        "train.max_steps": 240,
        "train.eval_every_steps": 60,
        "train.log_every_steps": 10,
        "checkpoint.every_steps": 40,
        "checkpoint.num_to_keep": 50,  # keep every checkpoint so the test can inspect them
        "fault_tolerance.max_failures": 3,
        "fault_tolerance.heartbeat_every_s": 0.5,
    }
    return load_config(DEMO, tiny_overrides(storage, **(base | extra)))


def start_training(handle: ClusterHandle, cfg: Config, attempt: int = 1, resume_from: str | None = None) -> str:
    """Prepare model + data exactly as the flow does, then submit the training job; returns the submission id."""
    model_path = prepare_base_model.fn(cfg)
    staged = stage_dataset.fn(cfg, model_path)
    spec = write_job_spec(cfg, attempt, staged.manifest_url, model_path, resume_from)
    return submit(handle, submission_id(cfg.name, attempt), "ray_jobs.job", spec)


def wait_job(handle: ClusterHandle, sid: str, timeout_s: float = 300) -> str:
    client = jobs_client(handle.address)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(sid)
        if status.is_terminal():
            return str(status)
        time.sleep(1)
    client.stop_job(sid)
    raise TimeoutError(f"job {sid} did not finish in {timeout_s}s; logs:\n{job_logs(handle, sid)[-5000:]}")


def job_logs(handle: ClusterHandle, sid: str) -> str:
    return jobs_client(handle.address).get_job_logs(sid)


def wait_for(what: str, predicate: Callable[[], object], timeout_s: float = 120, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def heartbeat(cfg: Config) -> dict:
    try:
        return json.loads(Path(Layout(cfg.storage).heartbeat(cfg.name)).read_text())
    except (FileNotFoundError, ValueError):
        return {"step": -1, "pid": None}


def heartbeat_step(cfg: Config) -> int:
    return heartbeat(cfg)["step"]


def rank0_pid(cfg: Config) -> int:
    """The rank-0 train worker of this run (its heartbeat names it): never a worker of another job."""
    return heartbeat(cfg)["pid"]


def train_worker_pids() -> list[int]:
    """PIDs of live Ray Train worker processes (their process title names the actor)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"RayTrainWorker" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def kill(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)


def final_weights_hash(cfg: Config) -> str:
    from safetensors.torch import load_file

    state = load_file(str(Path(Layout(cfg.storage).final_model(cfg.name)) / "model.safetensors"))
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
