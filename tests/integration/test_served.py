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
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from ray_jobs.config import ClusterConfig, load_config
from tasks.cluster import _reachable, jobs_client
from tests.conftest import ROOT, SAMPLE_DATA, tiny_overrides
from tests.integration.conftest import read_registry
from tests.procs import free_port, train_worker_pids, wait_for

pytestmark = pytest.mark.integration
SCREENSHOT_DIR = ROOT / ".unbroken" / "screenshots"
STEP_DELAY_S = 0.5  # 30 steps: ~15 s of training per run


class PrefectServer:
    """``prefect server start`` (SQLite, all services) on a loopback port; can be restarted on the same port and
    database, as an operator restarting it would."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.log = open(home / "server.log", "a")  # noqa: SIM115 (closed by stop)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api,
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")  # fmt: skip
        prefect = str(Path(sys.executable).parent / "prefect")
        self.proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for("the Prefect server", self.healthy, 90, 1.0)

    def healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.api}/health", timeout=2).read() == b"true"
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"))
    server.start()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api}):  # this test process is a client of it too
        yield server
    server.stop()
    server.log.close()


@pytest.fixture(scope="module")
def server(prefect_server) -> str:
    return prefect_server.api


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):
    """``unbroken serve`` with a tiny config; yields (config path, storage)."""
    root = tmp_path_factory.mktemp("served")
    storage = root / "storage"
    # Events may name datasets under this module's temp folders and the sample data's folder (the sensor watches
    # data.train) only; each step sleeps (a sleep changes no weight)
    # so a Prefect server restart lands mid-training; the variable reaches jobs only because it is passed through.
    passthrough = [*ClusterConfig().env_passthrough, "UNBROKEN_INJECT_DELAY"]
    extra = {
        "data.allowed_sources": [str(tmp_path_factory.getbasetemp()), str(SAMPLE_DATA.parent)],
        "cluster.env_passthrough": passthrough,
    }
    cfg = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(storage, name="served", **extra))
    config = root / "served.yaml"
    config.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    env = dict(os.environ, PREFECT_API_URL=server, PREFECT_RUNNER_POLL_FREQUENCY="2", PYTHONUNBUFFERED="1",
               PREFECT_HOME=str(root / "prefect-client"), UNBROKEN_INJECT_DELAY=f"step:{STEP_DELAY_S}")  # fmt: skip
    log = open(root / "serve.log", "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "unbroken", "serve", "--config", str(config), "--storage", str(storage),
           "--watchdog-interval", "3600", "--sensor-interval", "3600"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_for("the served deployments", lambda: len(_deployments()) >= 4, 120, 1.0)
    yield config, storage, root / "serve.log"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


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
        raise AssertionError(f"flow run {run_id} did not finish; serve log:\n{log.read_text()[-6000:]}") from None


def test_a_dataset_event_retrains_with_the_payloads_dataset(served, tmp_path_factory) -> None:
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    config, storage, log = served
    landing = tmp_path_factory.mktemp("landing") / "new-data.jsonl"
    shutil.copy(SAMPLE_DATA, landing)
    before = {r.id for r in _runs_of("finetune")}
    emit_event(event="unbroken.dataset.updated", resource={"prefect.resource.id": "unbroken.dataset.test"},
               payload={"dataset_uri": str(landing)})  # fmt: skip
    EventsWorker.drain_all()

    new = wait_for(
        "a finetune run from the trigger", lambda: [r for r in _runs_of("finetune") if r.id not in before], 60, 1.0
    )
    assert new[0].parameters["dataset_uri"] == str(landing)
    run = _final(new[0].id, 400, log)
    assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-6000:]}"
    assert run.name == "finetune-served"
    reg = read_registry(storage, "served")
    assert reg["state"] == "succeeded" and reg["config"]["data"]["train"] == str(landing)

    artifacts = _client_call(lambda c: c.read_artifacts(flow_run_filter=_by_id(run.id)))
    keys = {a.key for a in artifacts}
    assert {"served-progress", "served-metrics", "served-loss-curve", "served-summary", "served-ray-job",
            "served-final-model"} <= keys, keys  # fmt: skip
    progress = [a for a in artifacts if a.key == "served-progress"]
    assert progress and progress[0].data == 100.0
    curve = next(a for a in artifacts if a.key == "served-loss-curve")
    assert "xychart-beta" in curve.data and "line [" in curve.data
    _screenshot_of_artifacts(run.id, artifacts)


def _by_id(run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _screenshot_of_artifacts(run_id, artifacts) -> None:
    """Headless Chromium opens the run's Artifacts tab and the loss-curve artifact; the rendered pages must show
    the artifacts and a drawn chart. Screenshots are kept in .unbroken/screenshots/ for people to look at."""
    from prefect.settings import PREFECT_API_URL

    browser = _chromium()
    assert browser, "Chromium is needed for the UI check (Debian package `chromium`: `make browser`)"
    ui = PREFECT_API_URL.value().removesuffix("/api")
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    curve = next(a for a in artifacts if a.key == "served-loss-curve")
    pages = {
        "finetune-run-artifacts": f"{ui}/v2/runs/flow-run/{run_id}?tab=Artifacts",
        "finetune-loss-curve": f"{ui}/v2/artifacts/artifact/{curve.id}",
    }
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--window-size=1400,1800", "--virtual-time-budget=20000"]  # fmt: skip
    dom = {}
    for name, url in pages.items():
        dom[name] = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        shot = SCREENSHOT_DIR / f"{name}.png"
        subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
        assert shot.exists() and shot.stat().st_size > 10_000, f"a real screenshot of {url}"
    page = dom["finetune-run-artifacts"]
    assert "finetune-served" in page, "the run page carries the run's name"
    missing = [a.key for a in artifacts if a.key not in page]
    assert not missing, f"not visible in the UI: {missing}; page text:\n{page[-3000:]}"
    assert 'aria-roledescription="xychart"' in dom["finetune-loss-curve"], "mermaid drew the loss curve"


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
    from prefect.states import Cancelling

    config, storage, log = served
    long = ["train.max_steps=200000", "name=cancel-me", f"storage={storage}"]
    flow_run = run_deployment("finetune/finetune", parameters={"overrides": long}, timeout=0)

    def training():
        reg = read_registry(storage, "cancel-me") if (storage / "runs" / "cancel-me" / "run.json").exists() else {}
        return reg.get("state") == "running"

    wait_for("the Ray job to run", training, 300, 2)
    sid = read_registry(storage, "cancel-me")["attempts"][-1]["submission_id"]
    _client_call(lambda c: c.set_flow_run_state(flow_run.id, Cancelling(message="test cancels")))
    run = _final(flow_run.id, 120, log)
    assert run.state.is_cancelled(), run.state

    address = "http://127.0.0.1:8265"
    if _reachable(address) is None:  # the head may still be up; then the job must have ended
        assert jobs_client(address).get_job_status(sid).is_terminal()
    reg = read_registry(storage, "cancel-me")
    assert reg["state"] == "failed" and reg["attempts"][-1]["status"] in ("STOPPED", "FAILED"), reg
    assert not train_worker_pids(), "no Ray Train worker may outlive the cancelled run"


def test_an_event_naming_a_file_outside_the_allowed_sources_is_refused(served) -> None:
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    config, storage, log = served
    before = {r.id for r in _runs_of("finetune")}
    emit_event(event="unbroken.dataset.updated", resource={"prefect.resource.id": "unbroken.dataset.test"},
               payload={"dataset_uri": "file:///etc/passwd"})  # fmt: skip
    EventsWorker.drain_all()
    new = wait_for("the triggered run", lambda: [r for r in _runs_of("finetune") if r.id not in before], 60, 1.0)
    run = _final(new[0].id, 120, log)
    assert run.state.is_failed(), run.state
    assert "data.allowed_sources" in (run.state.message or "") + log.read_text()
    assert "root:" not in log.read_text(), "nothing of the refused file may be read"


def test_a_prefect_server_restart_mid_run_neither_stops_nor_doubles_training(served, prefect_server) -> None:
    from prefect.deployments import run_deployment

    config, storage, log = served
    flow_run = run_deployment("finetune/finetune", parameters={"overrides": ["name=restart-me"]}, timeout=0)
    jobs = RayJobsSeen("http://127.0.0.1:8265", "unbroken-restart-me-train-")
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
    assert jobs.seen == {"unbroken-restart-me-train-001"}, "one training job, ever (the head's own job list)"
    assert jobs.most_at_once == 1
    assert _weights(storage, "restart-me") == _weights(storage, "served"), "bit-identical to the same training"


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
