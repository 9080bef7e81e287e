"""Run training jobs on a real local Ray cluster without Prefect, and break them with real signals."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from control import registry
from control.backends.base import ClusterHandle, jobs_client
from control.describe import describe
from control.jobs import submit, write_job_spec
from control.registry import submission_id
from control.watchdog import check_run
from ray_jobs.config import ClusterConfig, Config, load_config
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.faults import FILE_ENV
from ray_jobs.storage import Layout, join, read_bytes
from ray_jobs.train import rowtrace
from tasks.model import prepare_base_model
from tasks.stage import stage_dataset
from tests.conftest import ROOT, tiny_overrides
from tests.procs import processes, train_worker_pids, wait_for  # noqa: F401 (the chaos tests import them from here)
from tests.trackers import TRACKING

DEMO = ROOT / "configs" / "demo.yaml"
CHAOS_PORT, CHAOS_GCS_PORT = 8285, 6399  # the chaos suite's head (conftest): its dashboard and GCS ports
REPORT: list[dict] = []  # one row per fault: what it cost (printed by conftest at the end of the session)
# Every job on the chaos suite's head -- each attempt a watchdog restarts too, and each on a head it starts again --
# reads its step delay from this file (ray_jobs/faults.py): the head's environment passes the variable to all
# of them (cluster.env_passthrough), so a test slows a run of several faults down for as long as it injects them.
DELAY_FILE = Path(tempfile.gettempdir()) / f"unbroken-chaos-delay-{os.getpid()}"
PASSTHROUGH = [*ClusterConfig().env_passthrough, FILE_ENV]


def chaos_config(root: Path, name: str, **extra: object) -> Config:
    """A tiny run long enough (~10 s of steps) to be interrupted mid-way; storage is ``root`` unless ``extra``
    names another (``storage="s3://..."``)."""
    base = {
        "name": name,
        "train.max_steps": 240,
        "train.eval_every_steps": 60,
        "train.log_every_steps": 10,
        "checkpoint.every_steps": 40,
        "checkpoint.num_to_keep": 50,  # keep every checkpoint so the test can inspect them
        "fault_tolerance.max_failures": 3,
        "fault_tolerance.heartbeat_every_s": 0.5,
        "cluster.dashboard_port": CHAOS_PORT,  # the chaos suite's head (conftest), where a watchdog re-provisions it
        "cluster.head_port": CHAOS_GCS_PORT,
        "cluster.keep_running": True,
        "cluster.env_passthrough": PASSTHROUGH,  # the head's (conftest): a run passing another set is refused it
    }
    return load_config(DEMO, tiny_overrides(root, **(base | extra)))


@contextmanager
def slow_steps(seconds: float) -> Iterator[None]:
    """Every training step of every job on the chaos suite's head takes ``seconds`` longer while inside (a sleep:
    the weights stay bit-identical); at full speed again after."""
    DELAY_FILE.write_text(f"step:{seconds}")
    try:
        yield
    finally:
        DELAY_FILE.unlink(missing_ok=True)


def start_training(
    handle: ClusterHandle, cfg: Config, attempt: int = 1, resume_from: str | None = None, env: dict | None = None
) -> str:
    """Prepare model + data exactly as the flow does, then submit the training job; returns the submission id.
    ``env``: variables for the job (``UNBROKEN_INJECT_DELAY`` to slow a phase down, see ray_jobs/faults.py)."""
    model_path = prepare_base_model.fn(cfg)
    staged = stage_dataset.fn(cfg, model_path)
    spec = write_job_spec(
        cfg, attempt, AttemptInputs(manifest_url=staged.manifest_url, model_path=model_path), resume_from
    )
    return submit(handle, submission_id(cfg.storage, cfg.name, attempt), "ray_jobs.job", spec, env=env)


def start_run(handle: ClusterHandle, cfg: Config, env: dict | None = None) -> str:
    """Attempt 1 of a run exactly as the finetune flow records it (registry + job spec + submit), minus Prefect:
    from here on a watchdog can look after it."""
    model_path = prepare_base_model.fn(cfg)
    staged = stage_dataset.fn(cfg, model_path)
    inputs = AttemptInputs(manifest_url=staged.manifest_url, model_path=model_path)
    attempt = registry.begin_attempt(cfg, handle.to_dict(), staged.dataset_id, inputs)
    spec = write_job_spec(cfg, attempt, inputs)
    return submit(handle, submission_id(cfg.storage, cfg.name, attempt), "ray_jobs.job", spec, env=env)


def driver_pid(cfg: Config, module: str = "ray_jobs.job") -> int | None:
    """The Ray job driver (``python -m <module> --spec .../runs/<run>/job-spec-NNN.json``) of this run."""
    needle, entry = f"/runs/{cfg.name}/job-spec-".encode(), f"-m {module} ".encode()
    for pid, cmdline in processes():
        if entry in cmdline and needle in cmdline and not cmdline.startswith(b"/bin/sh"):
            return pid
    return None


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


def uninterrupted_run(root: Path, **extra: object) -> tuple[str, Path]:
    """The chaos config trained once without interruption, and the hash of its final weights: what every broken run
    -- on the chaos suite's head, the multinode hosts, a ``ray up`` cluster -- must match bit for bit (same seed, same
    world size). Trained by two gloo processes under ``torchrun`` (``ray_jobs.local``: the loop Ray Train runs,
    without Ray), with its row trace (which rows every step trained, ray_jobs/train/rowtrace.py) in ``root/rows``;
    its checkpoints stay under ``root/storage/ray/baseline``, its TensorBoard and MLflow runs (both on) under
    ``root/storage`` (:func:`baseline_metrics`). ``extra``: overrides of a variant's baseline (``train.engine``).
    Returns (hash, row trace folder)."""
    return start_uninterrupted(root, **extra)()


def start_uninterrupted(root: Path, **extra: object) -> Callable[[], tuple[str, Path]]:
    """:func:`uninterrupted_run` started in the background (a scenario's own baseline trains while its faulted run
    waits on restarts); the returned function waits for it and returns what ``uninterrupted_run`` does."""
    cfg = chaos_config(root / "storage", "baseline", **TRACKING, **extra)  # what a resumed run's trackers show too
    model_path = prepare_base_model.fn(cfg)
    staged = stage_dataset.fn(cfg, model_path)
    spec = write_job_spec(cfg, 1, AttemptInputs(manifest_url=staged.manifest_url, model_path=model_path))
    rows = root / "rows"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{rowtrace.ENV: str(rows)})
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ray_jobs.local", "--spec", spec]
    out = (root / "baseline.log").open("w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def finish() -> tuple[str, Path]:
        code = p.wait(timeout=600)
        out.close()
        log = (root / "baseline.log").read_text()
        assert code == 0, f"the uninterrupted run failed (exit {code}):\n{log[-5000:]}"
        return final_weights_hash(cfg), rows

    return finish


def baseline_metrics(uninterrupted: tuple[str, Path]) -> dict[str, dict[int, float]]:
    """The uninterrupted run's logged metrics (``tests.trackers.logged``): what a resumed run's trackers must hold."""
    from tests.trackers import logged

    return logged(uninterrupted[1].parent / "storage", "baseline")


def first_checkpoint(handle: ClusterHandle, cfg: Config, sid: str, timeout_s: float = 600) -> tuple[str, dict]:
    """The run's first valid checkpoint (its manifest written: ``(url, manifest)``), waited for as long as its job runs: a machine the
    other lane loads takes minutes to start a job (its driver, Ray Train's controller and every worker importing torch
    and transformers: an FSDP job beside its own torchrun baseline once took 115 s to its first step). A job that
    ends before it wrote one fails here, with its log."""
    from ray_jobs import checkpoint as ckpt

    ckpts, client = Layout(cfg.storage).checkpoints_dir(cfg.name), jobs_client(handle.address)
    found = wait_for("the first checkpoint, or the job's end",
                     lambda: ckpt.find_latest_valid(ckpts) or client.get_job_status(sid).is_terminal(),
                     timeout_s=timeout_s, every_s=0.5)  # fmt: skip
    assert isinstance(found, tuple), f"the job ended before its first checkpoint:\n{job_logs(handle, sid)[-5000:]}"
    return found


def job_logs(handle: ClusterHandle, sid: str) -> str:
    return jobs_client(handle.address).get_job_logs(sid)


def heartbeat(cfg: Config) -> dict:
    try:
        return json.loads(read_bytes(Layout(cfg.storage).heartbeat(cfg.name)))
    except (FileNotFoundError, ValueError):
        return {"step": -1, "pid": None}


def heartbeat_step(cfg: Config) -> int:
    return heartbeat(cfg)["step"]


def rank0_pid(cfg: Config) -> int:
    """The rank-0 train worker of this run (its heartbeat names it): never a worker of another job."""
    return heartbeat(cfg)["pid"]


def kill(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)


def final_weights_hash(cfg: Config) -> str:
    from safetensors.torch import load

    state = load(read_bytes(join(Layout(cfg.storage).final_model(cfg.name), "model.safetensors")))
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def until_finished(cfg: Config, logs: list[Path] = (), timeout_s: float = 300) -> dict:
    """The run's registry once it is succeeded or failed; on a time-out, what it says and the tails of ``logs``."""

    def finished():
        reg = registry.load(cfg.storage, cfg.name)
        return reg if reg and reg.state in ("succeeded", "failed") else None

    try:
        return wait_for(f"run {cfg.name} to finish", finished, timeout_s=timeout_s, every_s=0.5)
    except TimeoutError:
        tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs)
        raise AssertionError(f"{describe(cfg.storage, cfg.name)}\n{tails}") from None


class WatchdogLoop:
    """The watchdog's passes over one run, in a thread, until the run ends; every outcome is kept."""

    def __init__(self, cfg: Config, every_s: float = 1.0):
        self.cfg, self.every_s, self.outcomes = cfg, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.outcomes.append(check_run(self.cfg.storage, self.cfg.name))
            except Exception as e:  # a pass that could not finish (e.g. storage away) is retried, as served
                self.outcomes.append(e)

    def __enter__(self) -> WatchdogLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def actions(self) -> list[str]:
        return [o.action if hasattr(o, "action") else f"error: {o}" for o in self.outcomes]


def ray_train_jobs(handle: ClusterHandle, cfg: Config) -> list[str]:
    """Every training job of this run the cluster ever ran (the Jobs API's own list)."""
    return sorted(
        j.submission_id
        for j in jobs_client(handle.address).list_jobs()
        if (j.submission_id or "").startswith(f"unbroken-{cfg.name}-{registry.storage_tag(cfg.storage)}-train-")
    )


def actor_classes(handle: ClusterHandle) -> dict[str, int]:
    """How many actors of each class the cluster has started, dead ones included (Ray's state API)."""
    from control import rayapi

    r, why = rayapi.get(handle.address, "/api/v0/actors?limit=10000&detail=false", 30.0)
    assert r is not None and r.status_code == 200, why or r.text[:500]
    counts: dict[str, int] = {}
    for actor in r.json()["data"]["result"]["result"]:
        counts[actor["class_name"]] = counts.get(actor["class_name"], 0) + 1
    return counts


def check_one_attempt(reg: dict, cfg: Config, baseline: str, handle: ClusterHandle) -> list[dict]:
    """Succeeded with one attempt and no restart; returns what the incident log says was observed."""
    status = describe(cfg.storage, cfg.name)
    assert reg.state == "succeeded", status
    assert len(reg.attempts) == 1 and reg.restarts == 0, status
    assert [i for i in reg.incidents if i.action != "observed"] == [], status
    assert ray_train_jobs(handle, cfg) == [registry.submission_id(cfg.storage, cfg.name, 1)]
    assert final_weights_hash(cfg) == baseline
    return reg.incidents
