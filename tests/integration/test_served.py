"""The deployments against a real ``prefect server start`` on loopback, served by a real ``unbroken serve``:
event-triggered retraining, the watchdog triggered by a failed finetune run, cancellation, and the UI in Chromium.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

from control import series
from control.backends.base import jobs_client, reachable
from control.backends.local import stop_local_head
from ray_jobs.config import ClusterConfig, load_config
from ray_jobs.search.trials import trial_states
from tests.conftest import ROOT, SAMPLE_DATA, tiny_overrides
from tests.integration.conftest import read_registry
from tests.prefect_server import serving
from tests.procs import processes, train_worker_pids, wait_for

pytestmark = pytest.mark.integration
SCREENSHOT_DIR = ROOT / ".unbroken" / "screenshots"
STEP_DELAY_S = 0.5  # 30 steps: ~15 s of training, for the run a Prefect server restart must land in
DELAY_FILE = Path(tempfile.gettempdir()) / f"unbroken-served-delay-{os.getpid()}"  # read by each job's workers
FIRST_RUN: list[str] = []  # the run the first dataset event made (later tests compare with it)
FIRST_LANDING: list[Path] = []
# Every run here passes the step-delay variable through (the module's one head is started with it: a run passing
# another set would be refused its ports, rightly); it reaches jobs only because it is passed through.
PASSTHROUGH = [*ClusterConfig().env_passthrough, "UNBROKEN_INJECT_DELAY_FILE"]


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """This module's own server (a test restarts it), not the session's shared one."""
    with serving(tmp_path_factory.mktemp("prefect-server")) as server:
        yield server


@pytest.fixture(scope="module")
def server(prefect_server) -> str:
    return prefect_server.api


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):
    """``unbroken serve`` with a tiny config; yields (config path, storage)."""
    root = tmp_path_factory.mktemp("served")
    storage = root / "storage"
    # Events may name datasets under this module's temp folders only. A run's steps sleep (a sleep changes no weight)
    # while DELAY_FILE names a delay, so a Prefect server restart lands mid-training.
    (root / "data").mkdir()
    shutil.copy(SAMPLE_DATA, root / "data" / "addition.jsonl")  # the scheduled run's data: a test may change it
    extra = {
        "data.train": str(root / "data" / "addition.jsonl"),
        "model.init_from": "series-champion",  # retraining warm-starts from the series' best model so far
        "data.allowed_sources": [str(tmp_path_factory.getbasetemp())],
        "cluster.env_passthrough": PASSTHROUGH,
        "cluster.keep_running": True,  # one head (8265) for the module's runs, stopped at its end: not one per run
    }
    cfg = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(storage, name="served", **extra))
    config = root / "served.yaml"
    config.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    env = dict(os.environ, PREFECT_API_URL=server, PREFECT_RUNNER_POLL_FREQUENCY="2", PYTHONUNBUFFERED="1",
               PREFECT_HOME=str(root / "prefect-client"), UNBROKEN_INJECT_DELAY_FILE=str(DELAY_FILE))  # fmt: skip
    log = open(root / "serve.log", "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "unbroken", "serve", "--config", str(config), "--storage", str(storage),
           "--watchdog-interval", "3600", "--sensor-interval", "3600"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    # the deployments, and their triggers' automations (created after them: an event sent before would be lost)
    wait_for("the served deployments and triggers", lambda: len(_deployments()) >= 5 and len(_automations()) >= 2,
             120, 1.0)  # fmt: skip
    yield config, storage, root / "serve.log"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    stop_local_head(cfg.cluster.dashboard_port)


def _client_call(fn):
    from prefect import get_client

    async def go():
        async with get_client() as c:
            return await fn(c)

    return asyncio.run(go())


def _deployments() -> list:
    try:
        return _client_call(lambda c: c.read_deployments())
    except Exception:
        return []


def _automations() -> list:
    try:
        return _client_call(lambda c: c.read_automations())
    except Exception:
        return []


def _runs_of(deployment: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    return _client_call(
        lambda c: c.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
    )


def _run(run_id):
    return _client_call(lambda c: c.read_flow_run(run_id))


def _final(run_id, timeout_s: float, log: Path):
    try:
        return wait_for("the flow run to finish", lambda: (r := _run(run_id)).state.is_final() and r, timeout_s, 2)
    except TimeoutError:
        own = "\n".join(line for line in log.read_text().splitlines() if "[ray]" not in line)  # the runner's lines
        raise AssertionError(f"flow run {run_id} did not finish; serve log (no job lines):\n{own[-6000:]}") from None


def test_a_dataset_event_retrains_with_the_payloads_dataset(served, tmp_path_factory) -> None:
    config, storage, log = served
    landing = tmp_path_factory.mktemp("landing") / "new-data.jsonl"
    shutil.copy(SAMPLE_DATA, landing)
    FIRST_LANDING.append(landing)
    before = {r.id for r in _runs_of("finetune")}
    _emit_dataset(str(landing))

    run = _final(_triggered_run(before, str(landing)).id, 400, log)
    assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-6000:]}"
    assert run.name == "finetune-served", "a served run is named by its series in the UI"
    [row] = series.table(str(storage), "served")  # served names runs <name>-{dataset}: this data's own run
    name = row["run"]
    assert name == f"served-{row['dataset'].removeprefix('ds-')[:8]}"
    reg = read_registry(storage, name)
    assert reg["state"] == "succeeded" and reg["config"]["data"]["train"] == str(landing)
    FIRST_RUN.append(name)
    assert (
        "model.init_from=series-champion: series served has no such run yet; starting from the base" in log.read_text()
    )

    artifacts = _client_call(lambda c: c.read_artifacts(flow_run_filter=_by_id(run.id)))
    keys = {a.key for a in artifacts}
    assert {f"{name}-progress", f"{name}-metrics", f"{name}-loss-curve", f"{name}-summary", f"{name}-ray-job",
            f"{name}-final-model", "series-served", "series-served-chart"} <= keys, keys  # fmt: skip
    progress = [a for a in artifacts if a.key == f"{name}-progress"]
    assert progress and progress[0].data == 100.0
    curve = next(a for a in artifacts if a.key == f"{name}-loss-curve")
    assert "xychart-beta" in curve.data and "line [" in curve.data
    _screenshot_of_artifacts(run.id, artifacts, name)


def _emit_dataset(uri: str) -> None:
    """Send the event through a client of this module's server. Not ``emit_event``: its process-wide events worker
    keeps the server it first connected to, and an earlier test in this process (an in-process flow run) may have
    started it against the session's server or a module server that has since stopped -- the event then never
    arrives here (the cause of a CI run's 180 s wait for the first triggered run)."""
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient
    from prefect.settings import PREFECT_API_URL

    event = Event(event="unbroken.dataset.updated", resource={"prefect.resource.id": "unbroken.dataset.test"},
                  payload={"dataset_uri": uri})  # fmt: skip

    async def send() -> None:
        async with PrefectEventsClient(api_url=PREFECT_API_URL.value()) as client:
            await client.emit(event)

    asyncio.run(send())


def _triggered_run(before: set, uri: str):
    new = wait_for(
        "a finetune run from the trigger", lambda: [r for r in _runs_of("finetune") if r.id not in before], 180, 1.0
    )  # an event reaches its automation in seconds; on a machine loaded to 10 it once took over 60
    assert new[0].parameters["dataset_uri"] == uri
    return new[0]


@pytest.mark.full(shard=2)  # a long end-to-end variant: three more served runs
def test_new_data_is_a_warm_started_run_of_the_series_and_the_same_data_again_trains_nothing(
    served, tmp_path_factory
) -> None:
    """Event B (other data) trains a second run of series ``served``, warm-started from the champion (the first
    run); event A again, and a cron-style run on the config's unchanged data, train nothing; new data where the
    scheduled run reads trains a third run."""
    from prefect.deployments import run_deployment

    config, storage, log = served
    first = FIRST_RUN[0]
    landing = tmp_path_factory.mktemp("landing-b") / "new-data.jsonl"
    lines = SAMPLE_DATA.read_text().splitlines()
    landing.write_text("\n".join(lines[: len(lines) * 2 // 3]) + "\n")  # another drop: another dataset id
    before = {r.id for r in _runs_of("finetune")}
    _emit_dataset(str(landing))
    run = _final(_triggered_run(before, str(landing)).id, 400, log)
    assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-6000:]}"
    rows = series.table(str(storage), "served")
    assert [r["run"] for r in rows][0] == first and len(rows) == 2, rows
    second = rows[1]["run"]
    assert rows[1]["parent"] == first and read_registry(storage, second)["inputs"]["parent"] == first
    first_eval = lambda run: next(r["eval_loss"] for r in _metrics(storage, run) if "eval_loss" in r)  # noqa: E731
    assert first_eval(second) < 0.8 * first_eval(first), "a warm start begins far below a base-model start"
    champion = min(rows, key=lambda r: r["score"])["run"]
    assert [r["run"] for r in rows if r["champion"]] == [champion]
    assert json.loads((storage / "series" / "served" / "champion.json").read_text())["run"] == champion
    kept = sorted(p.name for p in (storage / "ray" / second).glob("checkpoint-step-*"))
    assert kept == ["checkpoint-step-00000030"], "checkpoint.keep_after_success=1 after success"

    # The first run's data again: by event, and by a cron-style run on the config's data (the same content).
    for parameters in ({"dataset_uri": str(FIRST_LANDING[0])}, {}):
        before = {r.id for r in _runs_of("finetune")}
        if parameters:
            _emit_dataset(parameters["dataset_uri"])
            again = _triggered_run(before, parameters["dataset_uri"])
        else:
            again = run_deployment("finetune/finetune", timeout=0)
        done = _final(again.id, 300, log)
        assert done.state.is_completed(), done.state
        assert f"nothing new to train: run {first} already trained on dataset" in (done.state.message or "")
    assert len(series.table(str(storage), "served")) == 2, "no third run"
    # New data where the scheduled run reads: the next cron-style run trains it, a third run of the series.
    scheduled = Path(yaml.safe_load(config.read_text())["data"]["train"])
    scheduled.write_text("\n".join(lines[len(lines) // 3 :]) + "\n")
    try:
        done = _final(run_deployment("finetune/finetune", timeout=0).id, 400, log)
    finally:
        shutil.copy(SAMPLE_DATA, scheduled)  # later tests train the sample data from the base model
    assert done.state.is_completed() and "nothing new" not in (done.state.message or ""), done.state
    rows = series.table(str(storage), "served")
    assert len(rows) == 3 and rows[2]["state"] == "succeeded" and rows[2]["parent"] == champion, rows

    out = subprocess.run([sys.executable, "-m", "unbroken", "runs", "--series", "served", "--storage", str(storage)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
    lines_out = out.splitlines()[1:]
    assert [line.split()[1] for line in lines_out] == [r["run"] for r in rows]
    assert [line.rstrip().endswith("*") for line in lines_out] == [r["champion"] for r in rows]
    chart = next(a for a in _client_call(lambda c: c.read_artifacts(flow_run_filter=_by_id(run.id)))
                 if a.key == "series-served-chart")  # fmt: skip
    _screenshot("series-served-chart", f"/v2/artifacts/artifact/{chart.id}")


def _metrics(storage: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in (storage / "runs" / run / "metrics.jsonl").read_text().splitlines()]


def _by_id(run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _screenshot(name: str, path: str) -> str:
    """Headless Chromium renders a page of the Prefect UI into .unbroken/screenshots/<name>.png (kept for people to
    look at); returns the rendered DOM."""
    from prefect.settings import PREFECT_API_URL

    browser = _chromium()
    assert browser, "Chromium is needed for the UI check (Debian package `chromium`: `make browser`)"
    url = PREFECT_API_URL.value().removesuffix("/api") + path
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--window-size=1400,1800", "--virtual-time-budget=20000"]  # fmt: skip
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    shot = SCREENSHOT_DIR / f"{name}.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    assert shot.exists() and shot.stat().st_size > 10_000, f"a real screenshot of {url}"
    assert 'aria-roledescription="xychart"' in dom or "chart" not in name, f"mermaid drew the chart on {url}"
    return dom


def _screenshot_of_artifacts(run_id, artifacts, run: str) -> None:
    """The run's Artifacts tab and its loss-curve artifact, rendered: the page shows every artifact and a chart."""
    curve = next(a for a in artifacts if a.key == f"{run}-loss-curve")
    page = _screenshot("finetune-run-artifacts", f"/v2/runs/flow-run/{run_id}?tab=Artifacts")
    _screenshot("finetune-loss-chart", f"/v2/artifacts/artifact/{curve.id}")
    assert "finetune-served" in page, "the run page carries the run's name"
    missing = [a.key for a in artifacts if a.key not in page]
    assert not missing, f"not visible in the UI: {missing}; page text:\n{page[-3000:]}"


def test_a_failed_finetune_run_triggers_the_watchdog(served) -> None:
    from prefect.deployments import run_deployment

    config, storage, log = served
    before = {r.id for r in _runs_of("watchdog")}
    bad = run_deployment("finetune/finetune", parameters={"config_path": str(config) + ".missing"}, timeout=0)
    run = _final(bad.id, 120, log)
    assert run.state.is_failed(), run.state
    triggered = wait_for("a watchdog run", lambda: [r for r in _runs_of("watchdog") if r.id not in before], 90, 1.0)
    assert triggered[0].parameters["storage"] == str(storage)
    assert _final(triggered[0].id, 120, log).state.is_completed()


def test_cancelling_a_finetune_run_leaves_no_ray_job_running(served) -> None:
    from prefect.deployments import run_deployment

    config, storage, log = served
    long = ["train.max_steps=200000", "name=cancel-me", f"storage={storage}"]
    flow_run = run_deployment("finetune/finetune", parameters={"overrides": long}, timeout=0)

    def training():
        reg = read_registry(storage, "cancel-me") if (storage / "runs" / "cancel-me" / "run.json").exists() else {}
        return reg.get("state") == "running"

    wait_for("the Ray job to run", training, 300, 2)
    cancel(flow_run, storage, "cancel-me", log)
    assert not train_worker_pids(8265), "no Ray Train worker may outlive the cancelled run"


def cancel(flow_run, storage: Path, run: str, log: Path) -> dict:
    """Cancel the flow run while its job trains: it ends Cancelled, its Ray job has ended, and the run is ``failed``
    with its attempt stopped. Returns the run's record."""
    from prefect.states import Cancelling

    sid = read_registry(storage, run)["attempts"][-1]["submission_id"]
    _client_call(lambda c: c.set_flow_run_state(flow_run.id, Cancelling(message="test cancels")))
    final = _final(flow_run.id, 120, log)
    assert final.state.is_cancelled(), final.state
    address = "http://127.0.0.1:8265"
    if reachable(address) is None:  # the head may still be up; then the job must have ended
        assert jobs_client(address).get_job_status(sid).is_terminal()
    reg = read_registry(storage, run)
    assert reg["state"] == "failed" and reg["attempts"][-1]["status"] in ("STOPPED", "FAILED"), reg
    return reg


def test_an_event_naming_a_file_outside_the_allowed_sources_is_refused(served) -> None:
    config, storage, log = served
    before = {r.id for r in _runs_of("finetune")}
    _emit_dataset("file:///etc/passwd")
    new = wait_for("the triggered run", lambda: [r for r in _runs_of("finetune") if r.id not in before], 60, 1.0)
    run = _final(new[0].id, 120, log)
    assert run.state.is_failed(), run.state
    assert "data.allowed_sources" in (run.state.message or "") + log.read_text()
    assert "root:" not in log.read_text(), "nothing of the refused file may be read"


def test_a_prefect_server_restart_mid_run_neither_stops_nor_doubles_training(served, prefect_server) -> None:
    from prefect.deployments import run_deployment

    config, storage, log = served
    DELAY_FILE.write_text(f"step:{STEP_DELAY_S}")  # this run's workers read it when they start
    try:
        flow_run = run_deployment("finetune/finetune", parameters={"overrides": ["name=restart-me"]}, timeout=0)
        _restart_mid_run(flow_run, storage, log, prefect_server)
    finally:
        DELAY_FILE.unlink(missing_ok=True)


def _restart_mid_run(flow_run, storage: Path, log: Path, prefect_server) -> None:
    jobs = RayJobsSeen("http://127.0.0.1:8265", "unbroken-restart-me-")  # its training jobs: -<storage>-train-NNN
    beat = storage / "runs" / "restart-me" / "heartbeat.json"
    wait_for("training steps", lambda: beat.exists() and json.loads(beat.read_text()).get("step", 0) >= 3, 300, 1)
    prefect_server.stop()  # the API is away for as long as a restart takes (~15 s here)
    down_at_step = json.loads(beat.read_text())["step"]
    prefect_server.start()
    run = _final(flow_run.id, 400, log)
    jobs.stop()
    reg = read_registry(storage, "restart-me")
    assert down_at_step < reg["config"]["train"]["max_steps"], "the restart happened mid-training"
    assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-6000:]}"
    assert reg["state"] == "succeeded" and len(reg["attempts"]) == 1, reg
    assert jobs.seen == {reg["attempts"][0]["submission_id"]}, "one training job, ever (the head's own job list)"
    assert jobs.most_at_once == 1
    assert _weights(storage, "restart-me") == _weights(storage, FIRST_RUN[0]), "bit-identical to the same training"


class RayJobsSeen:
    """Samples the Ray job list of a head every second while it is up: which jobs with this prefix ever existed,
    and how many of them ran at the same time."""

    def __init__(self, address: str, prefix: str):
        self.address, self.prefix = address, prefix
        self.seen: set[str] = set()
        self.most_at_once = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            try:
                jobs = [
                    j for j in jobs_client(self.address).list_jobs() if (j.submission_id or "").startswith(self.prefix)
                ]
            except Exception:  # the head is not up (yet, or any more)
                continue
            self.seen |= {j.submission_id for j in jobs}
            self.most_at_once = max(self.most_at_once, sum(not j.status.is_terminal() for j in jobs))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _weights(storage: Path, run: str) -> str:
    import hashlib

    from safetensors.torch import load_file

    state = load_file(str(storage / "runs" / run / "final" / "model.safetensors"))
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


@pytest.mark.full(shard=2)  # cancelling again, a search's (a finetune run's: make test)
def test_cancelling_a_search_stops_its_job_and_every_trial(served) -> None:
    """The tune deployment's flow run cancelled mid-trial: the search's job is stopped, no trial's worker or
    driver outlives it, and no trial record says ``running`` afterwards."""
    from prefect.deployments import run_deployment

    _, storage, log = served
    long = tiny_overrides(storage, name="cancel-search", **{"train.max_steps": 200000, "train.eval_every_steps": 100,
                                                            "checkpoint.every_steps": 100, "cluster.keep_running": True,
                                                            "cluster.env_passthrough": PASSTHROUGH})  # fmt: skip
    flow_run = run_deployment("tune/tune", parameters={"overrides": long}, timeout=0)

    def a_trial_trains():
        found = trial_states(str(storage), "cancel-search")
        t00 = found.get("cancel-search-t00")
        return t00 is not None and t00.state == "running" and train_worker_pids(8265)

    wait_for("a trial to train", a_trial_trains, 300, 1.0)
    reg = cancel(flow_run, storage, "cancel-search", log)
    wait_for("no trial worker left", lambda: not train_worker_pids(8265), 60, 1.0)
    assert not [pid for pid, cmd in processes() if b"ray_jobs.search_job" in cmd and b"cancel-search" in cmd]
    states = {t: read_registry(storage, t)["state"] for t in reg["trials"]}
    assert "running" not in states.values() and states["cancel-search-t00"] == "failed", states
