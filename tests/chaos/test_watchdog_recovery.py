"""Faults Ray Train cannot recover from inside a job, recovered by the watchdog from outside.

Two real ``unbroken watchdog`` processes (each its own Prefect server) watch one storage root for the whole module,
so every scenario also checks that two watchdogs never both restart a run: exactly one incident and one restart per
fault, one attempt more than there were faults. Training runs with ``fault_tolerance.max_failures=0`` (the hf test
lets Ray Train absorb its worker kill), so every other fault reaches the watchdog. Each run must end with weights
bit-identical to its uninterrupted baseline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from control import registry
from control.backends.base import jobs_client
from control.backends.local import head_pids
from control.describe import describe
from control.jobs import stop_and_wait
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config
from ray_jobs.storage import Layout
from tests.chaos.harness import (
    CHAOS_PORT,
    REPORT,
    baseline_metrics,
    chaos_config,
    driver_pid,
    final_weights_hash,
    heartbeat,
    heartbeat_step,
    rank0_pid,
    slow_steps,
    start_run,
    start_uninterrupted,
    train_worker_pids,
    until_finished,
    wait_for,
)
from tests.conftest import ROOT
from tests.procs import scrape
from tests.trackers import TRACKING, check_trackers

pytestmark = pytest.mark.chaos

WATCHED = {
    "fault_tolerance.max_failures": 0,  # no in-job restarts: the watchdog must do it
    # Start-up and loading have their own limits now (phase_stall_s); 40 s keeps some slack for a loaded machine.
    "fault_tolerance.stall_timeout_s": 40,
    # An unreachable cluster is ambiguous: acted on once it held this long (a dead head stays dead).
    "fault_tolerance.confirm_s": 5,
    "fault_tolerance.restart_backoff_s": 1,
    "fault_tolerance.preemption_grace_s": 5,
    # A driver's death ends its job here: what the watchdog restarts (the run host's re-attach has its own tests)
    "fault_tolerance.run_host": False,
}


METRICS: list[str] = []  # the watchdogs' Prometheus endpoints (``--metrics-port 0``: each prints its own)


def counted(name: str, **labels: str) -> float:
    """``name`` summed over both watchdogs' endpoints (only the lease holder acts on a run)."""
    return sum(sum(scrape(url, name, **labels)) for url in METRICS)


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("watched") / "storage"


@pytest.fixture(scope="module")
def watchdogs(ray_cluster, watched, tmp_path_factory):
    """Two independent watchdog loops on the same storage (separate Prefect homes: separate servers, as two teams'
    would have), each serving its counters (``METRICS``: their URLs). Not the session's one server: two watchdogs
    writing a flow run every few seconds into one SQLite database lock each other out ("database is locked", seen
    here: both passes stalled 60 s, a driver kill went unnoticed as long). A pass every 4 s: each pass is a flow run,
    and a watchdog with its server takes ~14 % of a core at one every two seconds, ~8 % at one every four (the suite
    shares two cores; the faults here are noticed a pass or two later)."""
    procs = []
    for i in range(2):
        home = tmp_path_factory.mktemp(f"watchdog-{i}")
        env = dict(os.environ, PREFECT_HOME=str(home / "prefect"), PYTHONUNBUFFERED="1")
        env.pop("PREFECT_API_URL", None)  # not the session's shared server: each boots its own
        log = open(home / "watchdog.log", "w")  # noqa: SIM115 (closed with the process)
        cmd = [sys.executable, "-m", "unbroken", "watchdog", "--storage", str(watched), "--interval", "4",
               "--metrics-port", "0"]  # fmt: skip
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, home))
    logs = [home / "watchdog.log" for _, _, home in procs]
    # Ready once each has finished a pass: booting two Prefect servers takes both cores for ~15 s, which would
    # otherwise land on the first scenario's job start and read as a stall before its first step.
    for path in logs:
        wait_for(f"a first pass of {path.parent.name}", lambda p=path: "Finished in state Completed" in p.read_text(),
                 timeout_s=180, every_s=0.5)  # fmt: skip
    METRICS[:] = [re.search(r"watchdog metrics: (\S+)", p.read_text()).group(1) for p in logs]
    yield logs
    for p, log, _ in procs:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def watched_config(storage: Path, name: str, **extra: object) -> Config:
    return chaos_config(storage, name, **(WATCHED | extra))


def check_recovered(cfg: Config, reg: dict, baseline: str, kind: str, fault_at: float, scenario: str) -> dict:
    """The run finished by exactly one restart, bit-identical to the baseline; its cost goes into the report."""
    return check_restarts(cfg, reg, baseline, [(kind, fault_at, scenario)])[0]


def check_restarts(cfg: Config, reg: dict, baseline: str, faults: list[tuple[str, float, str]]) -> list:
    """The run finished by exactly one restart per fault ((incident kind, when, scenario), in order), bit-identical
    to the baseline; each fault's cost goes into the report. Returns the incidents acted on."""
    status = describe(cfg.storage, cfg.name)
    assert reg.state == "succeeded", status
    # (an API silent while the heartbeat was still fresh is observed on the way: the job may have lived)
    acted = [i for i in reg.incidents if i.action != "observed"]
    assert [i.kind for i in acted] == [kind for kind, _, _ in faults], status
    assert reg.restarts == len(faults) and len(reg.attempts) == len(faults) + 1, status
    for new, incident, (kind, fault_at, scenario) in zip(range(2, len(faults) + 2), acted, faults, strict=True):
        assert incident.action == "restarted" and incident.new_attempt == new, status
        assert reg.attempts[new - 1].started_by == "watchdog"
        assert reg.attempts[new - 1].resume_from == incident.resumed_from
        assert incident.first_new_step_at, status
        assert f"restarted as attempt {new} from step" in status and "lost steps" in status
        REPORT.append({"scenario": scenario, "detected_by": f"watchdog ({kind})",
                       "detection_s": incident.detected_at - fault_at,
                       "recovery_s": incident.first_new_step_at - fault_at, "lost_steps": incident.lost_steps})  # fmt: skip
    assert final_weights_hash(cfg) == baseline
    return acted


def started_and_checkpointed(cfg: Config, past_step: int = 50) -> None:
    """Waits for the run's first checkpoint, then for ``past_step``. The bounds are for a machine the other lane loads
    too (a DPO job beside its own baseline's two ranks once took over 180 s to its first checkpoint); a run that
    failed on the way ends the wait with its record, not a bare timeout."""
    ckpts = Layout(cfg.storage).checkpoints_dir(cfg.name)
    try:
        wait_for("a checkpoint", lambda: ckpt.find_latest_valid(ckpts) or _ended(cfg), timeout_s=420)
        wait_for(f"step {past_step}", lambda: heartbeat_step(cfg) > past_step or _ended(cfg), timeout_s=240)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; heartbeat {heartbeat(cfg)}\n{describe(cfg.storage, cfg.name)}") from None
    assert not _ended(cfg), describe(cfg.storage, cfg.name)


def _ended(cfg: Config) -> bool:
    """Whether the run's record says it ended (failed or gave up while a test waited for its progress)."""
    reg = registry.load(cfg.storage, cfg.name)
    return reg is not None and reg.state in ("failed", "succeeded", "stopped-early")


# The hf engine's trainers: HF's Trainer on the demo rows (SFT), TRL's DPOTrainer on the demo preference pairs, TRL's
# GRPOTrainer sampling for the demo prompts (its reward shipped with the job: configs/rewards/addition.py).
HF_RECIPES = {
    "sft": {},
    "dpo": {"data.train": str(ROOT / "configs" / "data" / "preferences.jsonl"), "data.format": "preference",
            "data.seq_len": 32, "train.hf_args": "{beta: 0.1}"},
    "grpo": {"data.seq_len": 32, "train.method": "grpo", "train.micro_batch_size": 4,
             "train.rewards": "[{function: configs.rewards.addition:starts_with_digit}]",
             "train.hf_args": "{num_generations: 4, max_completion_length: 4}"},
    "kto": {"data.train": str(ROOT / "configs" / "data" / "unpaired.jsonl"), "data.format": "unpaired_preference",
            "data.seq_len": 32, "train.method": "kto", "train.hf_args": "{beta: 0.1}"},
    "reward": {"data.train": str(ROOT / "configs" / "data" / "preferences.jsonl"), "data.format": "preference",
               "data.seq_len": 32, "train.method": "reward"},
}  # fmt: skip


def test_an_hf_engine_run_survives_a_killed_worker_then_a_killed_driver_bit_identical(
    ray_cluster, watched, watchdogs, tmp_path
) -> None:
    """``train.engine: hf`` with TRL's GRPOTrainer sampling for the demo prompts, scored by a reward function shipped
    with the job: kill -9 of a train worker after a checkpoint (Ray Train restarts the group in the job), then kill
    -9 of the job's driver (the watchdog restarts the run) -- it ends bit-identical to its uninterrupted hf run, each
    step once in TensorBoard and MLflow."""
    hf_faults(ray_cluster, watched, watchdogs, tmp_path, "grpo")


# Every other method's run under the same two faults: each resumed exactly in-process in make test (test_hf_engine.py,
# test_preference.py, test_kto.py, test_reward_model.py); spread over the full tier's shards by their cost
OTHER_RECIPES = [
    pytest.param("sft", marks=pytest.mark.full(shard=0)),
    pytest.param("kto", marks=pytest.mark.full(shard=1)),
    pytest.param("reward", marks=pytest.mark.full(shard=1)),
    pytest.param("dpo", marks=pytest.mark.full(shard=2)),
]


@pytest.mark.parametrize("recipe", OTHER_RECIPES)
def test_an_hf_run_of_each_other_method_survives_a_killed_worker_then_a_killed_driver_bit_identical(
    ray_cluster, watched, watchdogs, tmp_path, recipe
) -> None:
    """The same two faults for HF's own Trainer on the demo rows, TRL's DPOTrainer on preference pairs, its
    KTOTrainer on labelled completions and its RewardTrainer (a scalar head) on the preference pairs."""
    hf_faults(ray_cluster, watched, watchdogs, tmp_path, recipe)


def hf_faults(ray_cluster, watched, watchdogs, tmp_path, recipe: str) -> None:
    """A kill -9 of a train worker, then of the driver, of an hf run of ``recipe`` (``HF_RECIPES``)."""
    hf = {"train.engine": "hf", "train.max_steps": 120, **HF_RECIPES[recipe]}  # (room for two faults after step 50)
    hf_baseline = start_uninterrupted(tmp_path / "hf-baseline", **hf)  # trains while this run waits on restarts
    cfg = chaos_config(watched, f"hf-{recipe}-faults",
                       **(WATCHED | TRACKING | hf | {"fault_tolerance.max_failures": 1}))  # fmt: skip
    start_run(ray_cluster, cfg, env={"UNBROKEN_INJECT_DELAY": "step:0.05"})
    started_and_checkpointed(cfg)
    worker = rank0_pid(cfg)
    os.kill(worker, signal.SIGKILL)
    # Ray Train's controller says so in the heartbeat until the new group beats: no watchdog takes a slow restart
    # (the DPO trainer builds a reference model) for a dead job
    wait_for("the heartbeat to say the group restarts", lambda: heartbeat(cfg).get("phase") == "restarting",
             timeout_s=60, every_s=0.1)  # fmt: skip
    wait_for("the restarted group past its next checkpoint", lambda: rank0_pid(cfg) != worker
             and heartbeat_step(cfg) > 90, timeout_s=360)  # fmt: skip
    pid = wait_for("the job driver", lambda: driver_pid(cfg))
    fault_at = time.time()
    os.kill(pid, signal.SIGKILL)

    reg = until_finished(cfg, watchdogs)
    baseline = hf_baseline()
    check_recovered(cfg, reg, baseline[0], "job-failed", fault_at, f"kill -9 a worker, then the driver (hf {recipe})")
    check_trackers(cfg.storage, cfg.name, cfg.series_name, baseline_metrics(baseline))


@pytest.mark.full(shard=1)  # a driver's death again, the other way round: the driver lives on
def test_a_driver_orphaned_by_its_wrappers_death_is_stopped_before_the_restart_submits(
    ray_cluster, baseline, watched, watchdogs
) -> None:
    """Ray's ``/bin/sh`` wrapper around the job's driver is killed: Ray says the job FAILED, while the driver it
    orphaned trains on. The watchdog submits nothing until that job is seen to stop -- its heartbeat still moves, so
    its processes are stopped by their mark first -- then restarts it once; two jobs never train into one folder,
    and the run ends bit-identical."""
    import psutil

    cfg = watched_config(watched, "orphaned-driver")
    with slow_steps(0.1):
        sid = start_run(ray_cluster, cfg)
        started_and_checkpointed(cfg)
        driver = wait_for("the job's driver", lambda: driver_pid(cfg))
        wrapper = psutil.Process(driver).parent()
        assert wrapper is not None and wrapper.name() in ("sh", "dash", "bash"), wrapper
        killed_at = time.time()
        wrapper.kill()
        client = jobs_client(ray_cluster.address)
        wait_for("Ray to call the job failed", lambda: client.get_job_status(sid).is_terminal(), timeout_s=60)
        at = heartbeat_step(cfg)
        wait_for("the orphaned driver to train on", lambda: heartbeat_step(cfg) > at, timeout_s=60)
        assert psutil.pid_exists(driver), "the driver outlived its wrapper"
        reg = until_finished(cfg, watchdogs)  # (slowly: the orphan must not finish the run before it is stopped)
    check_restarts(cfg, reg, baseline, [("job-failed", killed_at, "kill -9 the driver's wrapper (orphaned driver)")])
    (said,) = [t for t in (log.read_text() for log in watchdogs) if f"run {cfg.name}: restarted as attempt 2" in t]
    stopped = said.find(f"run {cfg.name}: stopped the ")
    assert 0 <= stopped < said.find(f"run {cfg.name}: restarted as attempt 2"), "stopped before anything was submitted"
    assert not psutil.pid_exists(driver)


def test_a_torn_checkpoint_write_a_killed_driver_a_hang_and_a_lost_head_each_restart_the_run_bit_identical(
    ray_cluster, baseline, uninterrupted, watched, watchdogs
) -> None:
    """Four faults of one run, each a job the watchdog must restart (one run for all: the suite shares two cores):
    kill -9 of rank 0 while it writes a checkpoint -- the half-written one is skipped, the run resumes from the one
    before; kill -9 of the restarted job's driver -- resumed from the newest checkpoint; a train worker hung
    (SIGSTOP) -- the stall timeout notices; every process of the head killed -- the watchdog starts the head again.
    Beside it a run record from a newer release is marked active (written by a newer unbroken on the same storage):
    both watchdogs name it, count it, skip it, and still recover this run. It ends bit-identical, each step once in
    the trackers. Its steps are slowed (a sleep: the same bits) until the last fault, so no attempt ends first."""
    cfg = watched_config(watched, "four-faults", **TRACKING, **{"fault_tolerance.max_restarts": 4})
    newer_release_beside(watched)
    with slow_steps(0.1):
        start_run(ray_cluster, cfg)
        torn, write_killed_at = kill_mid_checkpoint_write(cfg)
        wait_for("attempt 2 past a checkpoint of its own", lambda: past_a_checkpoint(cfg, 2, torn), timeout_s=180)
        pid = wait_for("attempt 2's job driver", lambda: driver_pid(cfg))
        driver_killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        hung, hung_at = hang_a_worker_mid_step(cfg, attempt=3)
        try:
            wait_for("attempt 4 past a checkpoint of its own", lambda: past_a_checkpoint(cfg, 4), timeout_s=420)
        finally:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(hung, sig)
        down_at = time.time()
        for pid in head_pids(CHAOS_PORT):  # the whole head dies at once, as a lost machine's would; nothing else here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    reg = until_finished(cfg, watchdogs)
    write_kill, driver_kill, stalled, down = check_restarts(cfg, reg, baseline, [
        ("job-failed", write_killed_at, "kill -9 during a checkpoint write"),
        ("job-failed", driver_killed_at, "kill -9 the job driver"),
        ("stalled", hung_at, "SIGSTOP a train worker (hang)"),
        ("cluster-unreachable", down_at, "kill -9 every process of the head"),
    ])  # fmt: skip
    assert write_kill.resumed_step < ckpt.checkpoint_step(torn.name), "a half-written checkpoint was loaded"
    # Ray SIGTERMs the orphaned workers: they save a just-in-time checkpoint, so little or nothing is lost.
    assert driver_kill.resumed_step >= driver_kill.failed_step - cfg.checkpoint.every_steps
    # Not before the stall timeout, and not long after it (a pass every 4 s, plus a loaded machine's slack).
    assert cfg.fault_tolerance.stall_timeout_s <= stalled.silent_s < cfg.fault_tolerance.stall_timeout_s + 20
    assert "made no step" in stalled.detail
    assert down.reprovisioned, "the watchdog started the local head again"
    check_trackers(cfg.storage, cfg.name, cfg.series_name, baseline_metrics(uninterrupted))  # resumed further back
    # What the watchdogs' endpoints say of it: one incident and one restart a fault, whichever watchdog did it.
    assert counted("unbroken_watchdog_restarts_total", run=cfg.name) == 4
    assert counted("unbroken_watchdog_incidents_total", run=cfg.name, kind="job-failed") == 2
    assert counted("unbroken_watchdog_passes_total") > 0
    assert counted("unbroken_watchdog_left_alone_total", run="from-a-newer-release", reason="unreadable") >= 2
    for log in watchdogs:  # named by each (its log and its printed outcome) -- once, not once a pass
        said = log.read_text().count("from-a-newer-release/run.json: schema_version 99 is newer than this unbroken")
        assert 1 <= said <= 2, said


def test_a_killed_driver_leaves_its_run_host_training_and_a_new_driver_re_attaches(
    ray_cluster, baseline, watched, watchdogs
) -> None:
    """``fault_tolerance.run_host``: kill -9 of the job's driver mid-run. Ray Train's controller, its workers and the
    training function belong to the attempt's run host (a detached actor, ray_jobs/host.py), so the steps go on at
    once; a watchdog sees a FAILED job whose heartbeat moves and re-attaches a driver, which relays the run's end. The
    run ends succeeded in its one attempt -- nothing restarted, no step lost -- bit-identical."""
    cfg = watched_config(watched, "hosted", **{"fault_tolerance.run_host": True})
    with slow_steps(0.1):
        start_run(ray_cluster, cfg)
        started_and_checkpointed(cfg, past_step=20)
        pid = wait_for("the job driver", lambda: driver_pid(cfg))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        next_at = wait_for("a step after the kill", lambda: step_after(cfg, killed_at), timeout_s=60, every_s=0.05)
        wait_for("a driver re-attached", lambda: registry.load(cfg.storage, cfg.name).current.drivers, timeout_s=60)
    reg = until_finished(cfg, watchdogs)
    status = describe(cfg.storage, cfg.name)
    assert reg.state == "succeeded" and len(reg.attempts) == 1 and reg.restarts == 0, status
    assert reg.current.drivers and reg.current.submission_id.endswith("-d2"), status
    assert not [i for i in reg.incidents if i.action != "observed"], status  # nothing acted on, nothing counted
    assert counted("unbroken_watchdog_restarts_total", run=cfg.name) == 0
    # the re-attached driver relayed the run's end, and took its host down with it
    assert jobs_client(ray_cluster.address).get_job_status(reg.current.submission_id) == "SUCCEEDED", status
    wait_for("the run host gone", lambda: not run_hosts(ray_cluster.address), timeout_s=30)
    REPORT.append({"scenario": "kill -9 the job driver (run host alive)", "detected_by": "watchdog (driver-lost)",
                   "detection_s": 0.0, "recovery_s": next_at - killed_at, "lost_steps": 0})  # fmt: skip
    assert final_weights_hash(cfg) == baseline


@pytest.mark.full(shard=0)  # a stopped hosted job: nothing trains on unwatched
def test_a_stopped_job_takes_its_run_host_and_its_workers_down(ray_cluster, tmp_path) -> None:
    """A cancel, or the watchdog giving up, stops the job through the Jobs API: its driver, told by SIGTERM, kills
    its run host first, and Ray Train's workers (the host's) go with it -- a run host never trains on unwatched. (On
    storage no watchdog of this module looks at: a stopped job of a watched one would be restarted.)"""
    cfg = watched_config(tmp_path / "storage", "hosted-stopped", **{"fault_tolerance.run_host": True})
    with slow_steps(0.1):
        sid = start_run(ray_cluster, cfg)
        wait_for("training", lambda: heartbeat_step(cfg) > 5, timeout_s=300)
        wait_for("its run host", lambda: run_hosts(ray_cluster.address), timeout_s=30)
        stop_and_wait(ray_cluster.address, sid, 60)
    wait_for("the run host gone", lambda: not run_hosts(ray_cluster.address), timeout_s=30)
    wait_for("its workers gone", lambda: not alive_actors(ray_cluster.address, "RayTrainWorker"), timeout_s=60)


@pytest.mark.full(shard=1)  # a host whose driver is dead, stopped by the control plane (a cancel, a give-up, a restart)
def test_a_run_host_whose_driver_died_is_stopped_by_name_before_anything_else_runs(ray_cluster, tmp_path) -> None:
    """The driver killed -9 leaves its run host training (by design); when the run is then given up on, restarted or
    cancelled, nothing can signal that driver: the control plane's stop (``stop_leftovers``, which the watchdog's
    give-up and restart run; a cancel runs the same ``stop_run_host``) stops the host by name with a short job, and
    its controller and workers go with it. (Storage no watchdog of this module looks at.)"""
    from control.watchdog.restart import stop_leftovers

    cfg = watched_config(tmp_path / "storage", "hosted-orphan", **{"fault_tolerance.run_host": True})
    with slow_steps(0.1):
        sid = start_run(ray_cluster, cfg)
        wait_for("training", lambda: heartbeat_step(cfg) > 5, timeout_s=300)
        os.kill(wait_for("the job driver", lambda: driver_pid(cfg)), signal.SIGKILL)
        wait_for("the job failed", lambda: jobs_client(ray_cluster.address).get_job_status(sid) == "FAILED", 60)
        at = heartbeat_step(cfg)
        wait_for("the host training on", lambda: heartbeat_step(cfg) > at + 3, timeout_s=60)
        assert run_hosts(ray_cluster.address), "the host outlived its driver"
        stop_leftovers(cfg, registry.load_existing(cfg.storage, cfg.name), sid)
        assert not run_hosts(ray_cluster.address), "stopped, and gone, before stop_leftovers returned"
    wait_for("its workers gone: nothing trains on", lambda: not alive_actors(ray_cluster.address, "RayTrainWorker"),
             timeout_s=60)  # fmt: skip


def alive_actors(address: str, class_name: str) -> list[str]:
    """The actors of ``class_name`` alive on the cluster."""
    from ray.util.state import list_actors

    return [a.actor_id for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name == class_name]  # fmt: skip


def run_hosts(address: str) -> list[str]:
    """The run hosts alive on the cluster (ray_jobs/host.py), by name."""
    from ray.util.state import list_actors

    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.name for a in alive if (a.name or "").startswith("unbroken-host-")]


def step_after(cfg: Config, t: float) -> float | None:
    """When the run's first step after ``t`` was done (its heartbeat's ``last_step_at``), or None before it."""
    at = heartbeat(cfg).get("last_step_at")
    return at if at is not None and at > t else None


def newer_release_beside(storage: Path) -> None:
    """A run record a newer unbroken wrote on the same storage, marked active: no watchdog here can read it."""
    newer = Path(Layout(str(storage)).run_registry("from-a-newer-release"))
    newer.parent.mkdir(parents=True, exist_ok=True)
    newer.write_text(json.dumps({"schema_version": 99, "name": "from-a-newer-release", "state": "running"}))
    Path(Layout(str(storage)).active_index(), "from-a-newer-release").touch()


def kill_mid_checkpoint_write(cfg: Config) -> tuple[Path, float]:
    """kill -9 of rank 0 (it writes the checkpoints) while a checkpoint after the first is half-written: (that
    checkpoint's folder, when)."""
    ckpts = Path(Layout(cfg.storage).checkpoints_dir(cfg.name))
    wait_for("the first checkpoint", lambda: ckpt.find_latest_valid(str(ckpts)), timeout_s=180)
    victim = rank0_pid(cfg)

    def writing() -> Path | None:  # a checkpoint folder after the first whose manifest (written last) is not there yet
        for d in ckpts.glob("checkpoint-step-*"):
            if ckpt.checkpoint_step(d.name) > cfg.checkpoint.every_steps and not (d / "manifest.json").exists():
                return d
        return None

    partial = wait_for("a checkpoint write in progress", writing, timeout_s=120, every_s=0)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    assert not (partial / "manifest.json").exists(), f"the kill landed after {partial.name} was complete"
    return partial, killed_at


def past_a_checkpoint(cfg: Config, attempt: int, at_least: Path | None = None) -> bool:
    """Attempt ``attempt`` is the current one, trains, and wrote a valid checkpoint newer than the one it resumed
    from (and at or after ``at_least``), a few steps back."""
    reg = registry.load(cfg.storage, cfg.name)
    if reg is None or len(reg.attempts) != attempt or not reg.attempts[-1].resume_from:
        return False
    if heartbeat(cfg).get("attempt") != attempt:  # its workers have not beaten yet: the step is an older attempt's
        return False
    newest = ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(cfg.name))
    if newest is None or Path(newest[0]).name == Path(reg.attempts[-1].resume_from).name:
        return False
    step = ckpt.checkpoint_step(newest[0])
    return heartbeat_step(cfg) > step + 2 and (at_least is None or step >= ckpt.checkpoint_step(at_least.name))


def hang_a_worker_mid_step(cfg: Config, attempt: int) -> tuple[int, float]:
    """SIGSTOP of rank 1 once ``attempt`` trains, a few steps clear of an eval pass and a checkpoint (rank 0 then
    waits on rank 1 inside a training step, the stall this is about; stopped just before an eval, rank 0 would wait
    in its eval pass instead, and the watchdog rightly gives it phase_stall_s.evaluating, not stall_timeout_s):
    (the hung pid, when)."""
    every = (cfg.train.eval_every_steps, cfg.checkpoint.every_steps)

    def training_clear_of_other_phases() -> bool:
        beat = heartbeat(cfg)  # the attempt's own, once its workers step (an older attempt's says nothing)
        clear = all(3 < beat["step"] % n < n - 5 for n in every)
        return (
            beat.get("attempt") == attempt and beat.get("first_step_at") and beat.get("phase") == "training" and clear
        )

    wait_for(f"attempt {attempt} training, clear of other phases", training_clear_of_other_phases, timeout_s=300)
    victim = next(p for p in train_worker_pids(CHAOS_PORT) if p != rank0_pid(cfg))  # rank 1: rank 0 keeps beating
    hung_at = time.time()
    os.kill(victim, signal.SIGSTOP)
    return victim, hung_at
