"""What ``unbroken serve`` serves and what ``prefect.yaml`` declares are the same deployments; the sensor fires on
a new file and only then."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deployments.serve import ServeOptions, build
from tests.conftest import ROOT, SAMPLE_DATA


def served() -> dict:
    return {d.name: d for d in build(ServeOptions(config=str(ROOT / "configs" / "demo.yaml")))}


def declared() -> dict:
    from prefect.cli.deploy._models import PrefectYamlModel

    raw = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    PrefectYamlModel.model_validate(raw)  # what `prefect deploy` validates
    return {d["name"]: d for d in raw["deployments"]}


def test_served_deployments_and_prefect_yaml_agree() -> None:
    from prefect.cli.deploy._triggers import _initialize_deployment_triggers
    from prefect.flows import load_flow_from_entrypoint

    s, d = served(), declared()
    assert sorted(s) == sorted(d) == ["dataset-sensor", "finetune", "stage-dataset", "tune", "watchdog"]
    for name, dep in d.items():
        flow = load_flow_from_entrypoint(str(ROOT / dep["entrypoint"]))
        assert flow.name == s[name].flow_name, name
        assert dep["entrypoint"] == s[name].entrypoint.replace(str(ROOT) + "/", ""), name
        assert set(dep["parameters"]) <= set(s[name].parameters) | {"overrides"}, name
        # The same triggers: event names, resource matches, templated parameters.
        yaml_triggers = _initialize_deployment_triggers(name, dep.get("triggers", []))
        assert [(t.expect, t.match, t.match_related) for t in yaml_triggers] == [
            (t.expect, t.match, t.match_related) for t in s[name].triggers
        ], name
        for yt, st in zip(yaml_triggers, s[name].triggers, strict=True):
            assert set(yt.parameters) == set(st.parameters), name
            assert {k: v for k, v in yt.parameters.items() if "{{" in str(v)} == {
                k: v for k, v in st.parameters.items() if "{{" in str(v)
            }
        # Interval schedules match; the finetune cron exists in both forms (off by default in the yaml).
        yaml_intervals = [x["interval"] for x in dep.get("schedules", []) if "interval" in x]
        served_intervals = [x.schedule.interval.total_seconds() for x in s[name].schedules if hasattr(x.schedule, "interval")]  # fmt: skip
        assert yaml_intervals == served_intervals, name


def test_served_retraining_names_each_run_by_its_dataset_in_one_series() -> None:
    from deployments.serve import serve_name

    overrides = served()["finetune"].parameters["overrides"]
    assert (
        overrides[1:]
        == ["name=demo-{dataset}", "series.name=demo"]
        == declared()["finetune"]["parameters"]["overrides"]
    )
    assert serve_name("nightly-{date}") == [], "a config with its own template keeps it"


def test_finetune_is_retriggered_by_dataset_events_and_watchdog_by_finetune_failures() -> None:
    s = served()
    [dataset] = s["finetune"].triggers
    assert dataset.expect == {"unbroken.dataset.updated"}
    assert dataset.parameters["dataset_uri"] == "{{ event.payload.dataset_uri }}"
    [failed] = s["watchdog"].triggers
    assert failed.match["prefect.state-type"] == ["FAILED", "CRASHED"]  # TimedOut is a FAILED type too
    assert failed.match_related["prefect.resource.name"] == ["finetune", "tune"]


def test_the_sensor_emits_once_per_change_with_the_dataset_uri(tmp_path: Path, asserting_events) -> None:
    from prefect.events.worker import EventsWorker

    from flows.sensor import dataset_sensor

    source, storage = tmp_path / "landing", tmp_path / "storage"
    source.mkdir()
    (source / "part-0.jsonl").write_bytes(SAMPLE_DATA.read_bytes())
    first = dataset_sensor(str(source), str(storage))
    again = dataset_sensor(str(source), str(storage))
    (source / "part-1.jsonl").write_text(json.dumps({"input": "1+1=", "target": "2"}) + "\n")
    landed = dataset_sensor(str(source), str(storage))
    quiet = dataset_sensor(str(source), str(storage))
    EventsWorker.drain_all()

    assert (first["first_look"], first["changed"]) == (True, False)
    assert again["changed"] is False and quiet["changed"] is False
    assert landed["changed"] is True and landed["fingerprint"] != first["fingerprint"]
    events = [e for c in asserting_events.all for e in c.events if e.event == "unbroken.dataset.updated"]
    assert len(events) == 1
    assert events[0].payload["dataset_uri"] == str(source)
    assert events[0].payload["added"] == [str(source / "part-1.jsonl")]
    assert events[0].resource.id.startswith("unbroken.dataset.")


def test_serve_without_a_server_says_how_to_start_one(monkeypatch, capsys) -> None:
    from unbroken.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "PREFECT_API_URL is not set" in err and "unbroken server" in err


class _FlakyApi:
    """The two ``read_flow_runs`` calls of Prefect's cancel check: the first ``fails`` raise as a server that is
    away does; then the run is Cancelling."""

    def __init__(self, fails: int, run_id):
        self.fails, self.run_id, self.calls = fails, run_id, 0

    async def read_flow_runs(self, flow_run_filter):
        import httpx

        self.calls += 1
        if self.calls <= self.fails:
            raise httpx.ConnectError("All connection attempts failed")
        return [type("FlowRun", (), {"id": self.run_id})()]


@pytest.mark.parametrize(
    "websocket_ends, fails, cancels",
    [
        ("with an error", 0, True),  # Prefect polls too, but gives up after 3 failed polls: here 8 fail first
        ("with an error", 8, True),
        ("closed cleanly", 8, True),  # Prefect stops observing altogether
        ("cancelled", 0, False),  # the runner is stopping: no polling
    ],
)
def test_a_cancel_is_observed_however_long_the_prefect_server_was_away(websocket_ends, fails, cancels) -> None:
    import asyncio
    import uuid

    from deployments.cancels import LastingCancellingObserver

    run_id = uuid.uuid4()

    async def go() -> list:
        seen: list = []
        obs = LastingCancellingObserver(on_cancelling=seen.append, polling_interval=0.001)
        obs.add_in_flight_flow_run_id(run_id)
        obs._client = _FlakyApi(fails, run_id)

        async def websocket() -> None:
            if websocket_ends == "with an error":
                raise ConnectionError("no close frame received or sent")
            if websocket_ends == "cancelled":
                await asyncio.sleep(3600)

        consumer = asyncio.create_task(websocket())
        if websocket_ends == "cancelled":
            await asyncio.sleep(0)
            consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        obs._start_polling_task(consumer)
        for _ in range(2000):
            if seen or obs._polling_task is None:
                break
            await asyncio.sleep(0.001)
        obs._is_shutting_down = True
        if obs._polling_task is not None:
            await obs._polling_task
        return seen

    assert set(asyncio.run(go())) == ({run_id} if cancels else set())


def test_unbroken_serve_runs_prefects_runner_with_the_lasting_observer(monkeypatch) -> None:
    import prefect.runner.runner as runner

    from deployments.cancels import LastingCancellingObserver, install

    monkeypatch.setattr(runner, "FlowRunCancellingObserver", runner.FlowRunCancellingObserver)  # restored after
    install()
    assert runner.FlowRunCancellingObserver is LastingCancellingObserver
    monkeypatch.setattr(runner, "FlowRunCancellingObserver", object)  # a Prefect that moved it is refused
    with pytest.raises(RuntimeError, match="deployments/cancels.py"):
        install()
