"""Live metrics for Prometheus without a cluster: the training job's gauges (Ray's metrics API intercepted), the
watchdog's counters and their endpoint, the local head's metrics port, and the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.util.metrics

from control.watchdog import metrics as wd_metrics
from ray_jobs.config import ConfigError, load_config
from ray_jobs.storage import Layout
from ray_jobs.train.tracking import open_trackers
from ray_jobs.train.tracking.hub import RunInfo
from ray_jobs.train.tracking.prometheus import GAUGES, PrometheusTracker, count_start, live_tracker, refresh_s
from tests.conftest import ROOT

DASHBOARD = ROOT / "deployments" / "grafana" / "unbroken.json"


class FakeGauge:
    """``ray.util.metrics.Gauge`` as the tracker uses it: every ``set`` recorded, the last value per series kept."""

    values: dict[tuple[str, tuple], float] = {}
    sets: list[str] = []
    lock = threading.Lock()

    def __init__(self, name: str, description: str = "", tag_keys: tuple = ()):
        self.name, self.tag_keys = name, tag_keys

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert set(tags) == set(self.tag_keys), "every tag given, as Ray insists"
        with FakeGauge.lock:
            FakeGauge.values[(self.name, tuple(sorted(tags.items())))] = value
            FakeGauge.sets.append(self.name)


@pytest.fixture
def gauges(monkeypatch):
    FakeGauge.values, FakeGauge.sets = {}, []
    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeGauge)
    return FakeGauge


def value(name: str, run: str = "r", series: str = "s") -> float | None:
    return FakeGauge.values.get((name, (("run", run), ("series", series))))


def info(tmp_path: Path, attempt: int = 1, resumed_step: int | None = None) -> RunInfo:
    return RunInfo("r", "s", str(tmp_path), str(tmp_path / "runs" / "r"), attempt, resumed_step=resumed_step)


# -- the training job's gauges ----------------------------------------------------------------------------------
def test_every_gauge_keeps_its_last_value_and_rows_without_it_leave_it(tmp_path: Path, gauges) -> None:
    t = PrometheusTracker()
    t.open(info(tmp_path, attempt=2, resumed_step=40))
    try:
        assert value("unbroken_train_step") == 40 and value("unbroken_job_attempt") == 2
        assert value("unbroken_restarts") == 1, "attempt 2: one watchdog restart behind it"
        t.log(50, {"train/loss": 1.5, "train/lr": 1e-4, "train/grad_norm": 0.7, "perf/tokens_per_s": 900.0,
                   "perf/checkpoint_stall_s": 0.25})  # fmt: skip
        t.log(60, {"eval/loss": 1.25})
    finally:
        t.close("FINISHED", None)
    assert value("unbroken_train_step") == 60 and value("unbroken_eval_loss") == 1.25
    assert value("unbroken_train_loss") == 1.5 and value("unbroken_tokens_per_second") == 900.0
    assert value("unbroken_checkpoint_stall_seconds") == 0.25 and value("unbroken_grad_norm") == 0.7
    assert value("unbroken_learning_rate") == 1e-4
    assert value("unbroken_mfu") is None, "no GPU peak known: no MFU"
    assert {name for name, _ in gauges.values} <= set(GAUGES)


def test_every_gauge_shows_a_column_the_trackers_are_given() -> None:
    from ray_jobs.train.tracking.hub import METRICS

    shown = {column for column, _ in GAUGES.values() if column is not None}
    assert shown <= set(METRICS.values()), f"gauges of columns no row carries: {shown - set(METRICS.values())}"


def test_gauges_are_set_again_between_rows_until_the_tracker_closes(tmp_path: Path, gauges, monkeypatch) -> None:
    """Ray drops a gauge not set for two report intervals: the tracker refreshes every half interval."""
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    assert refresh_s() == 0.25
    t = PrometheusTracker()
    t.open(info(tmp_path))
    t.log(10, {"train/loss": 2.0})
    time.sleep(0.9)
    refreshed = gauges.sets.count("unbroken_train_loss")
    assert refreshed >= 3, f"set {refreshed} times in 0.9 s with no new row"
    t.close("FINISHED", None)
    time.sleep(0.3)
    after = gauges.sets.count("unbroken_train_loss")
    time.sleep(0.6)
    assert gauges.sets.count("unbroken_train_loss") == after, "closed: no more refreshes (the series expire)"


def test_mfu_is_tokens_per_second_times_flops_per_token_over_the_peak(tmp_path: Path, gauges) -> None:
    t = PrometheusTracker(flops_per_token=6e9, peak_flops=2 * 989.4e12)
    t.open(info(tmp_path))
    t.log(10, {"perf/tokens_per_s": 50_000.0})
    t.close("FINISHED", None)
    assert value("unbroken_mfu") == pytest.approx(50_000 * 6e9 / (2 * 989.4e12))


def test_in_job_restarts_are_counted_per_attempt_on_storage(tmp_path: Path, caplog) -> None:
    starts = Layout(str(tmp_path)).train_starts("r")
    assert [count_start(starts, 1) for _ in range(3)] == [0, 1, 2], "each new rank 0 of attempt 1: one more"
    assert count_start(starts, 2) == 0, "a new attempt starts its own count"
    (tmp_path / "runs" / "r" / "train-starts.json").write_text("{torn")
    assert count_start(starts, 2) == 0, "an unreadable count is not the run's problem"
    assert "in-job restarts counted from 0" in caplog.text


def test_the_tracker_is_on_only_in_a_ray_worker(tmp_path: Path, gauges, monkeypatch) -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "name=r"])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert live_tracker(cfg) == [] and open_trackers(cfg, 1, "ds", None) is None
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    [t] = live_tracker(cfg, model=object(), seq_len=128, world_size=2)
    assert t.flops_per_token is None and t.peak_flops is None, "a CPU run: no MFU"
    trackers = open_trackers(cfg, 1, "ds", None)
    assert [lane.tracker.name for lane in trackers.lanes] == ["prometheus"], "on whatever tracking: says"
    trackers.log({"step": 5, "loss": 3.0})
    assert trackers.close("FINISHED", timeout_s=10) == []
    assert value("unbroken_train_loss", series=cfg.series_name) == 3.0


def test_a_gpu_runs_mfu_basis_is_the_models_flops_and_every_gpus_peak(tmp_path: Path, monkeypatch) -> None:
    from ray_jobs.train import flops

    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "name=r", "cluster.use_gpu=true"])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(flops, "gpu_peak_flops", lambda: 989.4e12)
    monkeypatch.setattr(flops, "flops_per_token", lambda model, seq: 1e9 + seq)
    [t] = live_tracker(cfg, model=object(), seq_len=128, world_size=4)
    assert t.flops_per_token == 1e9 + 128 and t.peak_flops == 4 * 989.4e12


def test_flops_per_token_counts_every_linear_weight_once_and_attention(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ray_jobs.train.flops import flops_per_token

    c = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(c)
    per_layer = 2 * 32 * 32 + 2 * 32 * 2 * 8 + 3 * 32 * 64  # q, o; k, v (2 kv heads of 8); gate, up, down
    want = 6 * (2 * per_layer + 32 * 100) + 12 * 2 * 32 * 256  # + the (tied) output head; attention at 256
    assert flops_per_token(model, 256) == want
    assert flops_per_token(SimpleNamespace(modules=model.modules, module=model), 256) == want, "under a wrapper"


# -- the watchdog's counters --------------------------------------------------------------------------------------
def sample(name: str, **labels: str) -> float:
    return wd_metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_check_run_counts_the_incidents_it_records_and_the_restart_it_performs(tmp_path: Path, monkeypatch) -> None:
    import control.watchdog as wd
    from control.watchdog.decide import Outcome, Resubmit
    from tests.unit.test_decide import CFG, FAILED, NOW, Observations, record

    reg = record(config=CFG.model_dump(mode="json"), name="counted")
    monkeypatch.setattr(wd.registry, "load", lambda storage, run: reg)
    monkeypatch.setattr(wd, "observe", lambda reg, cfg, now: Observations(now, FAILED, metrics_step=80))
    monkeypatch.setattr(wd, "look", lambda cfg, reg, now: Observations(now, FAILED))  # the re-check: still failed
    carried = []
    monkeypatch.setattr(wd, "carry_out", lambda d, cfg, lease: carried.append(d) or Outcome(
        "counted", "restarted" if any(isinstance(a, Resubmit) for a in d.actions) else d.outcome.action))  # fmt: skip
    before = sample("unbroken_watchdog_incidents_total", run="counted", kind="job-failed")
    restarts = sample("unbroken_watchdog_restarts_total", run="counted")

    assert wd.check_run(str(tmp_path), "counted", now=NOW).action == "waiting"  # the backoff first
    assert sample("unbroken_watchdog_incidents_total", run="counted", kind="job-failed") == before + 1
    assert sample("unbroken_watchdog_restarts_total", run="counted") == restarts
    reg = carried[-1].record  # the next pass finds the incident open: no new one, a restart (re-checked first)
    assert wd.check_run(str(tmp_path), "counted", now=NOW + 3600).action == "restarted"
    assert sample("unbroken_watchdog_incidents_total", run="counted", kind="job-failed") == before + 1
    assert sample("unbroken_watchdog_restarts_total", run="counted") == restarts + 1


def test_the_endpoint_serves_the_counters_to_a_scrape() -> None:
    wd_metrics.acted("scraped", "restarted")
    wd_metrics.acted("scraped", "gave-up")
    wd_metrics.passed(3)
    port = wd_metrics.serve(0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert re.search(r'^unbroken_watchdog_restarts_total\{run="scraped"\} 1\.0$', body, re.M), body
    assert re.search(r'^unbroken_watchdog_gave_up_total\{run="scraped"\} 1\.0$', body, re.M), body
    assert re.search(r"^unbroken_watchdog_runs_watched 3\.0$", body, re.M), body
    assert "unbroken_watchdog_last_pass_timestamp_seconds" in body


# -- the local head's metrics port --------------------------------------------------------------------------------
def test_a_local_head_is_started_with_a_metrics_port_it_records(tmp_path: Path, monkeypatch) -> None:
    from control.backends import local, localhost

    monkeypatch.setattr(localhost, "HEADS_DIR", tmp_path)
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "cluster.metrics_port=9311"])
    assert "--metrics-export-port=9311" in local._head_command(cfg, tmp_path, 9311)
    assert local.metrics_url(8265) == "", "no head started here: nothing known"
    (tmp_path / "8265").mkdir()
    (tmp_path / "8265" / local.METRICS_PORT).write_text("9311")
    assert local.metrics_url(8265) == "http://127.0.0.1:9311/metrics"


@pytest.mark.parametrize(("overrides", "problem"), [
    (["cluster.metrics_port=8265"], "cluster.metrics_port: 8265 is also the head's GCS or dashboard port"),
    (["cluster.address=http://h:8265", "cluster.metrics_port=8080"], "cluster.metrics_port: set, but cluster.backend "
     "is address"),
])  # fmt: skip
def test_a_metrics_port_that_cannot_work_is_refused_naming_the_field(tmp_path: Path, overrides, problem) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", *overrides])
    assert load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}"]).cluster.metrics_port == 0


# -- the Grafana dashboard ----------------------------------------------------------------------------------------
def exported() -> set[str]:
    """Every series name this code exports: the job's gauges as Ray's endpoint names them, the watchdog's."""
    names = {f"ray_{g}" for g in GAUGES}
    for family in wd_metrics.REGISTRY.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return [p for p in out if p["type"] != "row"]


def test_every_panel_of_the_grafana_dashboard_reads_a_series_this_code_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"], "a Grafana 10+ dashboard"
    [ds] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    shown, known = set(), exported()
    for p in panels(dashboard):
        assert p["datasource"]["uid"] == f"${{{ds['name']}}}" and p["targets"], p["title"]
        for target in p["targets"]:
            names = set(re.findall(r"\b(?:ray_)?unbroken_\w+", target["expr"]))
            assert names, f"panel {p['title']!r} reads no unbroken series: {target['expr']}"
            assert names <= known, f"panel {p['title']!r} reads what nothing exports: {names - known}"
            shown |= names
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    missing = {f"ray_{g}" for g in GAUGES} | {"unbroken_watchdog_incidents_total", "unbroken_watchdog_restarts_total"}
    assert missing - shown == set(), "every training gauge and the watchdog's counts have a panel"
