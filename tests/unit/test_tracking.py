"""Experiment trackers as rank 0 drives them (ray_jobs/train/tracking), no Ray: real MLflow on SQLite, real W&B
offline, TensorBoard event files read back with TensorBoard's own reader. A run is one run in each, each step
once, across restarts that train steps again -- including a rank 0 killed outright -- and a tracker that fails or
hangs never holds a step up."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import types

import pytest

from ray_jobs.config import MLflowConfig, TensorBoardConfig, WandbConfig, load_config
from ray_jobs.storage import Layout, join
from ray_jobs.train.metrics import MetricsLog
from ray_jobs.train.tracking import RunInfo, Trackers, end_runs, open_trackers, tracked
from ray_jobs.train.tracking.mlflow import MLflowTracker, client, tracking_uri, whole_store
from ray_jobs.train.tracking.tensorboard import TensorBoardTracker
from ray_jobs.train.tracking.wandb import WandbTracker, folder, offline_history, offline_parts, run_id
from tests.conftest import ROOT
from tests.procs import wait_for
from tests.trackers import tensorboard_points

SERIES = "series-a"
PARAMS = {"train.lr": 1e-4, "model.lora.target_modules": ["q_proj", "v_proj"], "data.note": "x" * 7000,
          "tune.space.bad key!": 1, "cluster.max_workers": None}  # fmt: skip
FINAL = "file:///storage/runs/r/final"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One storage root for the file: its MLflow database is made once (~5 s), each test has runs of its own."""
    return str(tmp_path_factory.mktemp("store"))


class _Os(types.ModuleType):
    """``os`` as the TensorBoard tracker sees it here: every attempt a process of its own (its files are named by
    second, host and process id). Only its view: W&B takes a new process id for a fork and starts over."""

    def __init__(self) -> None:
        super().__init__("os")
        self.pids = iter(range(10_000, 20_000))

    def getpid(self) -> int:
        return next(self.pids)

    def __getattr__(self, name: str):
        return getattr(os, name)


@pytest.fixture(autouse=True)
def _distinct_tensorboard_files(monkeypatch):
    monkeypatch.setattr("ray_jobs.train.tracking.tensorboard.os", _Os())


def info(store: str, run: str, resumed: int | None = None, attempt: int = 0) -> RunInfo:
    return RunInfo(run, SERIES, store, join(store, "runs", run), attempt, "ds01", parent="parent-run",
                   resumed_step=resumed, params=PARAMS)  # fmt: skip


def row(step: int, scale: float = 1.0, speed: float = 100.0) -> dict:
    return {"step": step, "loss": scale / step, "lr": 1e-3 * step, "eval_loss": None, "tokens_per_s": speed * scale}


def attempt(trackers, at: RunInfo, steps, scale=1.0, status="FAILED", final=None, speed=100.0) -> None:
    """One rank 0 process: its metrics log (keeping the rows up to the resumed step) feeding its trackers; ``speed``:
    its tokens/s (a timing: each attempt measures its own)."""
    metrics = MetricsLog(Layout(at.storage).metrics(at.run), at.resumed_step)
    metrics.trackers = Trackers(trackers, at)
    for step in steps:
        metrics.append(row(step, scale, speed))
    assert metrics.flush(10)
    assert metrics.trackers.close(status, final, timeout_s=30) == []


def test_mlflow_keeps_one_run_and_each_step_once(store: str) -> None:
    run = "mlflow-run"
    metrics = MetricsLog(Layout(store).metrics(run), None)  # killed with steps 2..6 still in MLflow's queue:
    for step in range(1, 7):
        metrics.append(row(step))
    assert metrics.flush(10)
    first = MLflowTracker(MLflowConfig())
    first.open(info(store, run))
    first.log(1, tracked(row(1)))  # the run left RUNNING, with step 1 alone
    attempt([MLflowTracker(MLflowConfig())], info(store, run, 3, 1), range(4, 7))  # trained again, bit-identical
    attempt([MLflowTracker(MLflowConfig())], info(store, run, 3, 2), range(4, 7), status="FINISHED", final=FINAL,
            speed=50.0)  # fmt: skip

    mc = client(tracking_uri(MLflowConfig(), store))
    experiment = mc.get_experiment_by_name(SERIES)
    assert experiment.artifact_location == join(store, "mlflow-artifacts", SERIES)
    (found,) = mc.search_runs([experiment.experiment_id], filter_string=f"tags.\"unbroken.run\" = '{run}'")
    assert (found.info.run_name, found.info.status) == (run, "FINISHED")
    assert found.data.tags["unbroken.attempt"] == "2" and found.data.tags["unbroken.dataset"] == "ds01"
    assert found.data.tags["unbroken.parent"] == "parent-run"
    assert found.data.params["train.lr"] == "0.0001"
    assert found.data.params["model.lora.target_modules"] == '["q_proj", "v_proj"]'
    assert len(found.data.params["data.note"]) == 6000 and "tune.space.bad key!" not in found.data.params
    history = mc.get_metric_history(found.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / s) for s in range(1, 7)]
    timings = mc.get_metric_history(found.info.run_id, "perf/tokens_per_s")  # each step's first measurement, once
    assert [(m.step, m.value) for m in timings] == [(s, 100.0) for s in range(1, 7)]
    assert found.data.tags["unbroken.final_model"] == FINAL
    assert mc.download_artifacts(found.info.run_id, "final_model.txt", store + "/dl").endswith("final_model.txt")


def tensorboard_scalars(event_dir: str, tag: str) -> list[tuple[int, float]]:
    """``tests.trackers.tensorboard_points`` to 6 places (the event files hold float32)."""
    return [(step, round(value, 6)) for step, value in tensorboard_points(event_dir, tag)]


def test_tensorboard_and_wandb_show_each_step_once_from_the_latest_attempt(store: str) -> None:
    run = "latest-wins"

    def both():
        return [TensorBoardTracker(TensorBoardConfig()), WandbTracker(WandbConfig())]

    attempt(both(), info(store, run), range(1, 5))  # died before any checkpoint
    attempt(both(), info(store, run, None, 1), range(1, 7))  # a fresh start again
    attempt(both(), info(store, run, 3, 2), range(4, 7))  # from the checkpoint at 3, the same values
    attempt(both(), info(store, run, 3, 3), range(4, 7), scale=10.0, status="FINISHED", final=FINAL)  # new values

    want = [(s, round((10.0 if s > 3 else 1.0) / s, 6)) for s in range(1, 7)]
    assert tensorboard_scalars(join(store, "runs", run, "tensorboard"), "train/loss") == want
    root, rid = folder(WandbConfig(), info(store, run)), run_id(run, store)
    parts = offline_parts(root, rid)
    assert [p.branch for p in parts] == [None, 0, 0, 0] and [p.exit_code for p in parts] == [1, 1, 1, 0]
    history = offline_history(root, rid)
    assert [(s, round(r["train/loss"], 6)) for s, r in history.items()] == want
    assert sorted(parts[-1].history) == [1, 2, 3, 4, 5, 6]  # the latest folder alone holds the whole run


def test_wandb_offline_never_calls_out() -> None:
    """W&B's usage telemetry follows the process's settings, not the run's: made offline, it has no proxy."""
    from wandb.analytics.opentelemetry.opentelemetry_proxy import get_open_telemetry_proxy

    from ray_jobs.train.tracking.wandb import settings

    settings("offline")
    assert get_open_telemetry_proxy() is None


KILLED_RANK0 = """
import os, sys, time
from ray_jobs.config import load_config
from ray_jobs.storage import Layout
from ray_jobs.train.metrics import MetricsLog
from ray_jobs.train.tracking import open_trackers

cfg = load_config(sys.argv[1], sys.argv[2:])
metrics = MetricsLog(Layout(cfg.storage).metrics(cfg.name), None)
metrics.trackers = open_trackers(cfg, 0, "ds01", None)
for step in range(1, 7):
    metrics.append({"step": step, "loss": 1.0 / step, "lr": 1e-3 * step})
metrics.flush(10)
deadline = time.monotonic() + 20
while any(not lane.items.empty() for lane in metrics.trackers.lanes) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
os._exit(9)  # as Ray kills a worker: nothing closed, nothing flushed
"""


def killed_rank0(overrides: list[str]) -> None:
    """Rank 0 of a run logging steps 1..6 and then killed, in a process of its own."""
    demo = str(ROOT / "configs" / "demo.yaml")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # a Ray worker shares no W&B service
    done = subprocess.run([sys.executable, "-c", KILLED_RANK0, demo, *overrides], cwd=ROOT, env=env, timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 9, done.stderr[-3000:]


def test_a_killed_rank0_is_ended_by_the_control_plane_and_resumed_whole(store: str, monkeypatch, caplog) -> None:
    from control.records.run import Attempt, RunRecord
    from control.watchdog import act as acting
    from control.watchdog.decide import Decision, GiveUp, Outcome

    overrides = [f"storage={store}", "name=killed-run", "tracking.mlflow=true", "tracking.wandb=true",
                 "tracking.tensorboard=true"]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    killed_rank0(overrides)
    at = info(store, cfg.name)
    root, rid = folder(WandbConfig(), at), run_id(cfg.name, store)
    (lost,) = offline_parts(root, rid)
    assert lost.exit_code is None and len(lost.history) < 6  # W&B lost its unwritten block with the process

    # the watchdog gives up on the run (no cluster to stop here): its tracker runs end with it
    monkeypatch.setattr(acting, "stop_leftovers", lambda *a: None)
    reg = RunRecord(name=cfg.name, state="failed", attempts=[Attempt(attempt=1, submission_id="s1", started_at=0.0,
                                                                     started_by="finetune-flow")])  # fmt: skip
    with caplog.at_level(logging.INFO):
        acting.act(Decision(reg, [GiveUp()], Outcome(cfg.name, "gave-up")), cfg, None)
    assert "ended the mlflow and wandb run(s) of killed-run as FAILED: the watchdog gave up on it" in caplog.text
    assert end_runs(cfg, "FAILED") == []  # ended already: nothing to do
    mc = client(tracking_uri(cfg.tracking.mlflow, store))
    (found,) = mc.search_runs([mc.get_experiment_by_name(cfg.series_name).experiment_id],
                              filter_string="tags.\"unbroken.run\" = 'killed-run'")  # fmt: skip
    assert found.info.status == "FAILED"
    assert offline_parts(root, rid)[-1].exit_code == 1

    metrics = MetricsLog(Layout(store).metrics(cfg.name), 3)  # resumed from the checkpoint at step 3
    metrics.trackers = open_trackers(cfg, 1, "ds01", 3)
    for step in range(4, 7):
        metrics.append(row(step))
    assert metrics.trackers.close("FINISHED", FINAL, timeout_s=30) == []
    assert sorted(offline_history(root, rid)) == [1, 2, 3, 4, 5, 6]  # 1..3 written again from the metrics log
    # TensorBoard too (the killed writer had flushed nothing: its 5 s had not passed)
    assert tensorboard_scalars(join(store, "runs", cfg.name, "tensorboard"), "train/loss") == [
        (s, round(1.0 / s, 6)) for s in range(1, 7)
    ]
    assert len(mc.get_metric_history(found.info.run_id, "train/loss")) == 6
    assert mc.get_run(found.info.run_id).info.status == "FINISHED"


class Boom:
    name = "boom"

    def open(self, info) -> None: ...

    def log(self, step, metrics) -> None:
        raise ConnectionError("tracker server gone")

    def close(self, status, final_model) -> None: ...


class Hung(Boom):
    name = "hung"

    def __init__(self) -> None:
        self.release = threading.Event()

    def open(self, info) -> None:
        self.release.wait(30)

    def log(self, step, metrics) -> None: ...


def test_failing_or_hung_trackers_never_hold_a_step(store: str, monkeypatch, caplog) -> None:
    import mlflow  # noqa: F401  -- imported here, not on a lane thread during the timing (an import holds the GIL)

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = MLflowTracker(MLflowConfig(tracking_uri="http://127.0.0.1:9"))  # nothing answers there
    hung = Hung()
    caplog.set_level(logging.WARNING, logger="unbroken.tracking")
    hub = Trackers([Boom(), hung, down], info(store, "troubled"))
    for step in range(1, 101):  # each returns at once: nothing here waits for a tracker
        hub.log(row(step))
    assert not hung.release.is_set() and hub.lanes[1].thread.is_alive(), "logged while a tracker hangs in open"
    assert hub.close("FINISHED", None, timeout_s=1.0) == ["hung"]
    hung.release.set()
    warned = [r.getMessage() for r in caplog.records if r.name == "unbroken.tracking"]
    assert len(warned) == 3, warned
    assert sum("tracker boom failed to log" in w for w in warned) == 1
    assert sum("tracker mlflow failed to open" in w for w in warned) == 1
    assert sum("tracker hung did not finish" in w for w in warned) == 1


class Linked(Boom):
    """A tracker that opens and says where its run is, as each real one does."""

    def __init__(self, name: str, links: dict[str, str]) -> None:
        self.name, self.links = name, links

    def log(self, step, metrics) -> None: ...


def test_every_trackers_links_land_in_one_tracking_file_read_through_its_model(store: str) -> None:
    """Each lane adds its tracker's links to ``tracking.json`` (one model for the writer and the flow's artifact); a
    file of the first version (tracker names at the top) is read as it was; a torn one is written anew, never a
    tracker's failure."""
    from ray_jobs.contracts.tracking import TrackingLinks
    from ray_jobs.storage import write_json_atomic
    from tasks.report import tracking_markdown

    at = info(store, "linked")
    url = Layout(store).tracking("linked")
    write_json_atomic(url, {"old": {"dir": "/x", "view": "look at /x"}})  # version 1
    hub = Trackers([Linked("a", {"dir": "/a", "url": "http://a/run", "view": "cmd a"}),
                    Linked("b", {"run_id": "r1", "sync": "sync b"})], at)  # fmt: skip
    assert hub.close("FINISHED", None, timeout_s=10) == [] and not [lane.failed for lane in hub.lanes if lane.failed]
    links = TrackingLinks.read(url)
    assert links is not None and links.schema_version == 2 and sorted(links.trackers) == ["a", "b", "old"]
    assert (links.look("a"), links.look("b"), links.look("old"), links.where("a")) == (
        "http://a/run", "sync b", "look at /x", {"dir": "/a"})  # fmt: skip
    assert "| a | dir `/a` | `http://a/run` |" in tracking_markdown(links)

    with open(url.removeprefix("file://"), "w") as f:
        f.write('{"a": {"dir"')  # torn by a host crash
    hub = Trackers([Linked("c", {"dir": "/c"})], at)
    assert hub.close("FINISHED", None, timeout_s=10) == [] and hub.lanes[0].failed is None
    assert TrackingLinks.read(url).trackers == {"c": {"dir": "/c"}}


def test_wandb_run_ids_are_what_wandb_takes_and_stable() -> None:
    long = "nightly-" + "x" * 80 + ".v2/a b"
    ids = {run_id(name, "/s") for name in ("r1", "r1", long)} | {run_id("r1", "s3://b/p")}
    assert len(ids) == 3 and all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", i) for i in ids)
    assert run_id("r1", "/s").startswith("r1-")


def test_ending_a_runs_trackers_never_holds_up_the_control_plane(store: str, monkeypatch, caplog) -> None:
    """A tracking server that never answers (the watchdog giving up, a cancel): the caller waits ``wait_s``, not the
    client's minutes of retries, and says the runs were not ended."""
    from control.tracking import end_tracker_runs

    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={store}", "name=stuck", "tracking.mlflow=true"])
    release, finished = threading.Event(), threading.Event()

    def hangs(cfg, status):
        release.wait(30)
        finished.set()
        return ["mlflow"]

    monkeypatch.setattr("ray_jobs.train.tracking.end_runs", hangs)
    caplog.set_level(logging.INFO)
    try:
        assert end_tracker_runs(cfg, "FAILED", "the watchdog gave up on it", wait_s=1.0) == []
        assert not finished.is_set(), "returned while the tracker was still not answering"
        assert "the tracker runs of stuck were not ended within 1 s" in caplog.text
    finally:
        release.set()
    monkeypatch.setattr("ray_jobs.train.tracking.end_runs", lambda cfg, status: ["mlflow"])
    assert end_tracker_runs(cfg, "FAILED", "the watchdog gave up on it") == ["mlflow"]
    assert "ended the mlflow run(s) of stuck as FAILED: the watchdog gave up on it" in caplog.text


def test_an_mlflow_store_killed_while_it_is_made_is_made_again_whole(tmp_path) -> None:
    """kill -9 of the process making the SQLite store, mid-migration: no half-made database is left where MLflow
    looks (every later client would refuse it), and the next rank 0 makes the store and tracks the run."""
    storage = str(tmp_path)
    uri = tracking_uri(MLflowConfig(), storage)
    making = subprocess.Popen([sys.executable, "-c", "import sys; from ray_jobs.train.tracking.mlflow import "
                               "whole_store; whole_store(sys.argv[1])", uri], cwd=ROOT)  # fmt: skip
    try:
        wait_for("the store being made", lambda: list(tmp_path.glob("mlflow.db.*.making")), 120, 0.01)
    finally:
        making.kill()
        making.wait(30)
    assert making.returncode == -9, "killed while it made the store"
    assert not (tmp_path / "mlflow.db").exists()
    attempt([MLflowTracker(MLflowConfig())], info(storage, "after-kill"), range(1, 4), status="FINISHED")
    mc = client(uri)
    (found,) = mc.search_runs([mc.get_experiment_by_name(SERIES).experiment_id])
    assert [m.step for m in mc.get_metric_history(found.info.run_id, "train/loss")] == [1, 2, 3]
    whole_store(uri)  # there already: kept as it is
    assert len(mc.search_runs([mc.get_experiment_by_name(SERIES).experiment_id])) == 1


def test_every_tracking_section_names_a_tracker_module_and_nothing_else_names_them() -> None:
    """A tracker is one module (``ray_jobs/train/tracking/<name>.py`` with its ``TRACKER``) and its config section:
    ``open_trackers`` and ``end_runs`` find it by the section's name, and no other product file names it."""
    import importlib
    import re

    from ray_jobs.config.tracking import TrackingConfig

    names = list(TrackingConfig.model_fields)
    for name in names:
        assert isinstance(importlib.import_module(f"ray_jobs.train.tracking.{name}").TRACKER, type), name
    pattern = re.compile(rf"[\"'.]({'|'.join(names)})\b")
    found = []
    for path in (ROOT / "ray_jobs" / "train" / "tracking" / "__init__.py", *(ROOT / "control").rglob("*.py")):
        found += [f"{path.name}: {m.group(0)}" for m in pattern.finditer(path.read_text())]
    assert not found, found
