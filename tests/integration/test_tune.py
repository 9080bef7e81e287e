"""A hyperparameter search (``unbroken tune``) end to end on a real local Ray head with the session's Prefect server:
ASHA stops a trial, the winner is promoted, every trial is a run; then the same search again under a killed trial
worker, a killed search driver and a killed head, recovered by a real watchdog to the same trials, decisions,
winner and bit-identical weights.

One head for the module (its own ports); 3 trials of 60 steps of the tiny model, one at a time. The faulted search's
steps are slowed by 0.2 s each (``DELAY_FILE``, which the head's jobs read: a sleep changes no number) so each fault
lands inside a trial; the uninterrupted one runs at full speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from control import rayapi, registry, series
from control.backends.local import head_pids, start_local_head, stop_local_head
from control.jobs import submit, write_job_spec
from control.records.series import EvalPin
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, load_config
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.contracts.trials import TrialEntry
from ray_jobs.faults import FILE_ENV
from ray_jobs.search.trials import trial_states, trials
from ray_jobs.storage import Layout
from tasks.model import prepare_base_model
from tasks.stage import stage_dataset
from tests.chaos.harness import driver_pid, final_weights_hash, heartbeat, until_finished
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import run_cli
from tests.procs import wait_for

DEMO_TUNE = ROOT / "configs" / "demo-tune.yaml"
PORT, GCS_PORT = 8315, 6429  # this module's head, nobody else's
DELAY = "step:0.2"
DELAY_FILE = Path(tempfile.gettempdir()) / f"unbroken-tune-delay-{os.getpid()}"  # the faulted search writes it


def tune_args(root: Path, name: str) -> list[str]:
    return tiny_overrides(root, **{
        "name": name, "train.max_steps": 60, "train.eval_every_steps": 20, "checkpoint.every_steps": 20,
        "checkpoint.num_to_keep": 10, "train.log_every_steps": 10, "train.warmup_steps": 0,
        "fault_tolerance.max_failures": 1, "fault_tolerance.heartbeat_every_s": 0.5,
        "fault_tolerance.confirm_s": 3, "fault_tolerance.restart_backoff_s": 1,
        "cluster.dashboard_port": PORT, "cluster.head_port": GCS_PORT, "cluster.keep_running": True,
        "cluster.env_passthrough": f"[{FILE_ENV}]",
        "tune.num_trials": 3, "tune.grace_period_steps": 20, "tune.space": "{train.lr: {loguniform: [1.0e-3, 1.0e-1]}}",
    })  # fmt: skip


def tune_config(root: Path, name: str) -> Config:
    return load_config(DEMO_TUNE, tune_args(root, name))


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    os.environ[FILE_ENV] = str(DELAY_FILE)  # the head's jobs inherit it (cluster.env_passthrough)
    handle = start_local_head(tune_config(tmp_path_factory.mktemp("tune-head"), "head"))
    yield handle
    stop_local_head(handle)
    os.environ.pop(FILE_ENV, None)
    DELAY_FILE.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def clean(head, tmp_path_factory) -> tuple[Config, dict[str, TrialEntry], str]:
    """The search run uninterrupted through ``unbroken tune`` (the tune flow): its config and trials.json."""
    storage = tmp_path_factory.mktemp("tune-clean") / "storage"
    r = run_cli("tune", str(DEMO_TUNE), *[f"--set={a}" for a in tune_args(storage, "clean")], timeout=600)
    assert r.returncode == 0, r.explain()
    cfg = tune_config(storage, "clean")
    return cfg, trial_states(cfg.storage, cfg.name), r.stdout


def left_on_the_head(address: str) -> tuple[list, list]:
    """Placement groups not removed and actors alive of the search's kinds (the head's own daemons aside), from
    the head's state API."""
    kinds = ("ImplicitFunc", "TrainController", "RayTrainWorker", "PlacementGroupCleaner", "_QueueActor")
    pgs = [p for p in _state(address, "placement_groups") if p["state"] != "REMOVED"]
    actors = [a for a in _state(address, "actors") if a["state"] == "ALIVE" and a["class_name"] in kinds]
    return pgs, actors


def _state(address: str, what: str) -> list[dict]:
    r, why = rayapi.get(address, f"/api/v0/{what}?limit=10000", 30)
    assert r is not None and r.ok, why or r.text[:500]
    return r.json()["data"]["result"]["result"]


def by_index(found: dict[str, TrialEntry]) -> list[TrialEntry]:
    return sorted(found.values(), key=lambda t: t.index)


def test_a_search_stops_a_trial_early_promotes_its_winner_and_leaves_nothing_behind(head, clean) -> None:
    cfg, found, stdout = clean
    states = [t.state for t in by_index(found)]
    assert "stopped-early" in states and "completed" in states, states
    assert all(t.starts == 1 for t in found.values()), found
    best = series.winner(found)
    assert f"winner {best}: promoted" in stdout, stdout
    assert series.champion(cfg.storage, cfg.series_name).run == best
    entry = series.load(cfg.storage, cfg.series_name).entry(cfg.name)
    assert entry.trials == [t.name for t in trials(cfg)] and entry.winner == best and entry.verdict.promoted
    for t in trials(cfg):  # every trial a run, with its values and how it ended
        reg = registry.load(cfg.storage, t.name)
        assert reg.search == cfg.name and reg.params == t.params
        assert reg.state == {"completed": "succeeded", "stopped-early": "stopped-early"}[found[t.name].state]
    runs = run_cli("runs", "--storage", cfg.storage, "--series", cfg.series_name)
    for t in trials(cfg):
        line = next(ln for ln in runs.stdout.splitlines() if f" {t.name} " in ln)
        assert "train.lr=" in line and reg_state(cfg, t.name) in line, runs.stdout
    tables = {a.key: a for a in _artifacts([f"{cfg.name}-trials", f"{cfg.name}-trials-chart"])}
    rows = tables[f"{cfg.name}-trials"].data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert [r["trial"] for r in rows] == [t.name for t in trials(cfg)] and {"train.lr", "state", "steps"} <= set(
        rows[0]
    )
    assert "xychart-beta" in tables[f"{cfg.name}-trials-chart"].data  # each trial's eval loss over steps
    wait_for("the search's placement groups and actors to go", lambda: _gone(head.address), timeout_s=60)


def _artifacts(keys: list[str]) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))


def reg_state(cfg: Config, run: str) -> str:
    return registry.load(cfg.storage, run).state


def _gone(address: str) -> bool:
    return left_on_the_head(address) == ([], [])


def start_search(handle, cfg: Config) -> None:
    """Attempt 1 of a search exactly as the tune flow records it (trials, series, attempt, job spec), minus Prefect:
    from here on the watchdog looks after it."""
    model_path = prepare_base_model.fn(cfg)
    staged = stage_dataset.fn(cfg, model_path)
    pin = EvalPin(dataset_id=staged.dataset_id, manifest_url=staged.manifest_url, source="the search's eval split")
    series.begin_run(cfg, staged.dataset_id, pin, None, None)
    inputs = AttemptInputs(manifest_url=staged.manifest_url, model_path=model_path, score_manifest_url=pin.manifest_url)
    names = [t.name for t in series.record_trials(cfg, staged.dataset_id, inputs)]
    attempt = registry.begin_attempt(cfg, handle.to_dict(), staged.dataset_id, inputs, trials=names)
    spec = write_job_spec(cfg, attempt, inputs)
    submit(handle, registry.submission_id(cfg.storage, cfg.name, attempt), "ray_jobs.search_job", spec)


@pytest.fixture
def watchdog(tmp_path):
    def start(storage: str):
        log = open(tmp_path / "watchdog.log", "w")  # noqa: SIM115 (closed below)
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # with the delay file's variable: a head it starts again has it
        cmd = [sys.executable, "-m", "unbroken", "watchdog", "--storage", storage, "--interval", "2"]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        return tmp_path / "watchdog.log"

    procs: list = []
    yield start
    for p, log in procs:
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=30)
        p.kill()
        log.close()


def running_past(cfg: Config, trial: str, step: int) -> bool:
    """The trial trains past ``step`` with a checkpoint behind it (its own heartbeat and checkpoints)."""
    found = trial_states(cfg.storage, cfg.name)
    beat = heartbeat(cfg.named(trial))
    return (
        trial in found
        and found[trial].state == "running"
        and beat.get("phase") == "training"
        and beat.get("step", 0) > step
        and ckpt.find_latest_valid(Layout(cfg.storage).checkpoints_dir(trial))
    )


def test_a_search_survives_a_killed_worker_driver_and_head_to_the_same_outcome(head, clean, watchdog, tmp_path):
    base_cfg, base, _ = clean
    cfg = tune_config(tmp_path / "storage", "faulted")
    t = [tr.name for tr in trials(cfg)]
    log = watchdog(cfg.storage)
    DELAY_FILE.write_text(DELAY)
    start_search(head, cfg)

    # Where each fault lands: a trial the uninterrupted search let train past step 25 (ASHA stops others sooner).
    past = [i for i, tr in enumerate(by_index(base)) if tr.step > 25]
    assert past[0] == 0 and len(past) >= 2, f"the config must let two trials past step 25: {by_index(base)}"
    lost_driver, lost_head = past[0], past[1]

    wait_for("trial 0 past step 25", lambda: running_past(cfg, t[0], 25), timeout_s=240, every_s=0.1)
    killed = heartbeat(cfg.named(t[0]))["pid"]
    os.kill(killed, signal.SIGKILL)  # its rank 0: Ray Train restarts it inside the trial

    # The same trial, back from its checkpoint in the same job, trains on past its next one; then the search's
    # driver is lost in it: the watchdog resubmits, Tune restores the trial
    wait_for("trial 0 back and past step 45", lambda: heartbeat(cfg.named(t[0])).get("pid") not in (None, killed)
             and running_past(cfg, t[0], 45), timeout_s=240, every_s=0.1)  # fmt: skip
    os.kill(driver_pid(cfg, "ray_jobs.search_job"), signal.SIGKILL)
    wait_for("attempt 2", lambda: len(registry.load(cfg.storage, cfg.name).attempts) == 2, timeout_s=120)

    wait_for(f"trial {lost_head} past step 25", lambda: running_past(cfg, t[lost_head], 25), timeout_s=300,
             every_s=0.1)  # fmt: skip
    for pid in head_pids(PORT):  # the whole head at once, as a lost machine's
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    reg = until_finished(cfg, [log], timeout_s=420)
    assert reg.state == "succeeded", reg
    # (the API silent while the search's heartbeat was still fresh is observed on the way: it may have lived)
    acted = [i for i in reg.incidents if i.action != "observed"]
    assert [i.kind for i in acted] == ["job-failed", "cluster-unreachable"], reg.incidents
    assert acted[1].reprovisioned and len(reg.attempts) == 3
    # what a restart trains again: the running trial's steps past its newest checkpoint (every 20), not the search's
    assert all(0 <= i.lost_steps <= 40 for i in acted), [i.lost_steps for i in acted]
    found = trial_states(cfg.storage, cfg.name)
    theirs = {f"{base_cfg.name}-t{i:02d}": n for i, n in enumerate(t)}
    for name, mine in theirs.items():  # the same decisions, steps and eval losses, trial by trial
        assert (found[mine].state, found[mine].history) == (base[name].state, base[name].history), name
    starts = [found[n].starts for n in t]
    again = (lost_driver, lost_head)  # started again after the driver, then the head, was lost in it
    assert starts == [2 if i in again else 1 for i in range(len(t))], (
        f"a worker kill is Ray Train's to absorb "
        f"inside its trial; a trial finished before a loss is never re-run: starts {starts}"
    )
    assert series.winner(found) == theirs[series.winner(base)]
    for name, mine in theirs.items():
        if base[name].state == "completed":  # bit-identical to the uninterrupted search's trial
            assert final_weights_hash(_named(cfg, mine)) == final_weights_hash(_named(base_cfg, name)), name
    assert series.champion(cfg.storage, cfg.series_name).run == theirs[series.winner(base)]
    address = registry.load(cfg.storage, cfg.name).cluster.address
    wait_for("the search's placement groups and actors to go", lambda: _gone(address), timeout_s=60)


def _named(cfg: Config, run: str) -> Config:
    return cfg.named(run)
