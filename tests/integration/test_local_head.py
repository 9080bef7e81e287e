"""A local head started by unbroken is ours alone: stopped by its own processes (never a machine-wide ``ray stop``),
shared heads stopped by their last user, an allow-listed environment, every port on loopback, no secret in errors."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from control.backends.base import ClusterError, jobs_client, reachable
from control.backends.local import _run, head_pids, start_local_head, stop_local_head
from ray_jobs.config import load_config
from ray_jobs.train.tracking.prometheus import REPORT_INTERVAL_ENV
from tasks.cluster import stop_cluster
from tests.conftest import ROOT, tiny_overrides
from tests.procs import scrape, wait_for

pytestmark = pytest.mark.integration
DEMO = ROOT / "configs" / "demo.yaml"
A = {"cluster.dashboard_port": 8401, "cluster.head_port": 6501}  # this module's heads, nobody else's
B = {"cluster.dashboard_port": 8402, "cluster.head_port": 6502}
SECRET = "unbroken-flow-only-secret-value"


def config(tmp_path: Path, name: str, ports: dict, **extra):
    return load_config(DEMO, tiny_overrides(tmp_path / name, name=name, **ports, **extra))


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory):
    """Two local heads at once, started with a secret and a passed-through variable in the flow's environment."""
    tmp = tmp_path_factory.mktemp("heads")
    os.environ.update(UNBROKEN_TEST_SECRET=SECRET, UNBROKEN_TEST_SHARED="visible")
    own_interval = REPORT_INTERVAL_ENV not in os.environ
    os.environ.setdefault(REPORT_INTERVAL_ENV, "1000")  # Ray reports metrics every second (a RAY_* variable: passed)
    passthrough = "[AWS_ACCESS_KEY_ID, UNBROKEN_TEST_SHARED]"
    handles = []
    try:
        for name, ports in (("a", A), ("b", B)):
            cfg = config(tmp, name, ports, **{"cluster.env_passthrough": passthrough})
            handles.append(start_local_head(cfg))
            assert handles[-1].started_here, f"a Ray head already answers on {ports}"
        yield handles
    finally:
        for h in handles:
            stop_local_head(h)
        for k in ("UNBROKEN_TEST_SECRET", "UNBROKEN_TEST_SHARED", *([REPORT_INTERVAL_ENV] if own_interval else [])):
            os.environ.pop(k, None)


def job_output(address: str, code: str) -> str:
    client = jobs_client(address)
    sid = client.submit_job(entrypoint=f"python -c {code!r}")
    wait_for("the job", lambda: client.get_job_status(sid).is_terminal(), timeout_s=120, every_s=0.5)
    return client.get_job_logs(sid)


def test_a_job_sees_only_allow_listed_variables_of_the_flows_environment(two_heads) -> None:
    out = job_output(two_heads[0].address, "import os; print(os.environ.get('UNBROKEN_TEST_SECRET'), "
                     "os.environ.get('UNBROKEN_TEST_SHARED'), os.environ.get('PREFECT_HOME'))")  # fmt: skip
    assert "None visible None" in out, out
    assert SECRET not in out


def listening_sockets(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket the processes hold (from /proc, both IPv4 and IPv6)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append((inodes[cols[9]], _address(cols[1])))
    return found


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{'.'.join(str(b) for b in reversed(raw))}:{int(port, 16)}"
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # IPv6: four little-endian words
    flat = b"".join(words)
    if flat[:12] == b"\0" * 10 + b"\xff\xff":
        return f"{'.'.join(str(b) for b in flat[12:])}:{int(port, 16)}"  # v4-mapped
    return f"[{flat.hex()}]:{int(port, 16)}"


def test_the_heads_metrics_endpoint_serves_a_running_jobs_step(two_heads, tmp_path) -> None:
    """Scraped while a job trains: rank 0's gauges are on the head's metrics port, the step moving with the run.
    Its MLflow server is down all along: the run trains on and succeeds, with one warning, and TensorBoard gets
    every step."""
    from tests.chaos.harness import heartbeat_step, job_logs, start_training, wait_job
    from tests.trackers import logged, tensorboard_points

    handle = two_heads[0]
    assert handle.metrics_url.startswith("http://127.0.0.1:"), handle
    cfg = config(tmp_path, "live", A, **{"train.max_steps": 300, "train.log_every_steps": 10,
                                          "checkpoint.every_steps": 100, "cluster.num_workers": 1,
                                          "fault_tolerance.heartbeat_every_s": 0.5, "tracking.tensorboard": "true",
                                          "tracking.mlflow.tracking_uri": "http://127.0.0.1:9"})  # fmt: skip
    env = {"UNBROKEN_INJECT_DELAY": "step:0.03", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}  # nothing answers on :9
    sid = start_training(handle, cfg, env=env)  # >= 9 s of steps
    seen: list[tuple[float, int]] = []  # (scraped step, heartbeat step right after)

    def two_steps_seen() -> bool:
        steps = scrape(handle.metrics_url, "ray_unbroken_train_step", run="live", series=cfg.series_name)
        at = heartbeat_step(cfg)
        if steps and 0 < at < 300:
            seen.append((max(steps), at))
        return len({s for s, _ in seen if s > 0}) >= 2

    wait_for("two steps of the run on the head's metrics endpoint", two_steps_seen, timeout_s=180, every_s=0.5)
    assert all(step <= at and step % 10 == 0 for step, at in seen), f"a logged step, not ahead of training: {seen}"
    assert [s for s, _ in seen] == sorted(s for s, _ in seen), f"the step only moves forward: {seen}"
    for gauge, want in (("ray_unbroken_restarts", 0.0), ("ray_unbroken_job_attempt", 1.0)):
        assert scrape(handle.metrics_url, gauge, run="live") == [want], gauge
    assert scrape(handle.metrics_url, "ray_unbroken_tokens_per_second", run="live")[0] > 0
    assert scrape(handle.metrics_url, "ray_unbroken_mfu", run="live") == [], "a CPU run has no MFU"
    assert wait_job(handle, sid) == "SUCCEEDED"
    warned = re.findall(r"tracker (\w+) failed to (\w+)", job_logs(handle, sid))
    assert warned == [("mlflow", "open")], warned
    shown = tensorboard_points(Path(cfg.storage) / "runs" / "live" / "tensorboard", "train/loss")
    assert [s for s, _ in shown] == sorted(logged(cfg.storage, "live")["loss"]), shown


def test_every_port_of_a_local_head_listens_on_loopback_only(two_heads) -> None:
    pids = head_pids(A["cluster.dashboard_port"])
    sockets = listening_sockets(pids)
    assert len(sockets) >= 6, f"GCS, raylet, dashboard, agents: expected several listeners, got {sockets}"
    exposed = [(pid, a) for pid, a in sockets if not (a.startswith("127.") or a.startswith(f"[{'0' * 31}1]"))]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_stopping_one_head_leaves_the_other_running(two_heads, tmp_path) -> None:
    a, b = two_heads
    extra = config(tmp_path, "extra", {"cluster.dashboard_port": 8403, "cluster.head_port": 6503})
    c = start_local_head(extra)
    victims = head_pids(8403)
    assert victims and reachable(c.address) is None
    stopped = stop_local_head(c)
    assert sorted(stopped) == sorted(victims)
    assert not [p for p in victims if Path(f"/proc/{p}").exists() and "Z" not in _state(p)], "all its processes end"
    assert reachable(c.address) is not None
    assert reachable(a.address) is None and reachable(b.address) is None, "the other heads are untouched"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_shared_head_is_stopped_by_its_last_user(tmp_path) -> None:
    ports = {"cluster.dashboard_port": 8404, "cluster.head_port": 6504}
    first, second = config(tmp_path, "first", ports), config(tmp_path, "second", ports)
    h1 = start_local_head(first)
    try:
        h2 = start_local_head(second)
        assert h1.started_here and not h2.started_here
        stop_cluster.fn(first, h1, run="first")  # the run that started it ends first
        assert reachable(h1.address) is None, "the second run still uses it"
        # A user whose process is gone and whose run is not active no longer holds the head up.
        users = Path(f"/tmp/unbroken-ray/{ports['cluster.dashboard_port']}/users")
        assert [json.loads(p.read_text())["run"] for p in users.glob("*.json")] == ["second"]
        stop_cluster.fn(second, h2, run="second")
        wait_for("the head to stop", lambda: reachable(h1.address) is not None, timeout_s=30)
    finally:
        stop_local_head(h1)


def test_errors_never_carry_the_ray_token_or_a_secret(monkeypatch) -> None:
    token = "rAyToKeN-0123456789abcdef0123456789"
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    monkeypatch.setenv("HF_TOKEN", "hf_secretsecretsecret")
    with pytest.raises(ClusterError) as e:
        _run(["sh", "-c", f"echo token is {token}; echo hf_secretsecretsecret >&2; exit 3"], dict(os.environ), "x")
    assert token not in str(e.value) and "hf_secretsecretsecret" not in str(e.value)
    assert "token is ***" in str(e.value)


def test_a_kept_head_is_not_stopped_by_a_run(tmp_path) -> None:
    ports = {"cluster.dashboard_port": 8405, "cluster.head_port": 6505}
    cfg = config(tmp_path, "kept", ports, **{"cluster.keep_running": True})
    h = start_local_head(cfg)
    try:
        stop_cluster.fn(cfg, h, run="kept")
        time.sleep(1)
        assert reachable(h.address) is None
    finally:
        stop_local_head(h)
    assert reachable(h.address) is not None
