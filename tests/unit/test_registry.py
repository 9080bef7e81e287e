"""Run registry: attempts are recorded, and a run name is not silently reused for an incompatible training."""

from __future__ import annotations

from pathlib import Path

import pytest

from control import registry
from control.records.run import RunRecord
from ray_jobs.config import load_config
from tests.conftest import ROOT


def cfg(storage: Path, *overrides: str):
    return load_config(ROOT / "configs" / "demo.yaml", [f"storage={storage}", "name=r", *overrides])


def test_attempts_are_numbered_and_their_end_recorded(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    assert registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1") == 1
    registry.end_attempt(c, 1, "FAILED", "boom")
    assert registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1") == 2
    reg = registry.end_attempt(c, 2, "SUCCEEDED", final_model="/f")
    assert reg.state == "succeeded" and reg.final_model == "/f"
    assert [(a.submission_id, a.status) for a in reg.attempts] == [
        (registry.submission_id(c.storage, "r", 1), "FAILED"),
        (registry.submission_id(c.storage, "r", 2), "SUCCEEDED"),
    ]
    assert reg.attempts[0].message == "boom"


def test_reusing_a_run_name_with_compatible_changes_is_allowed(tmp_path: Path) -> None:
    registry.begin_attempt(cfg(tmp_path), {"address": "a"}, "ds-1")
    registry.check_compatible(cfg(tmp_path, "train.max_steps=5000", "checkpoint.every_steps=7"), "ds-1")
    # made elastic with the same max: the data layout (and so every checkpoint) still fits
    registry.check_compatible(cfg(tmp_path, "cluster.num_workers={min: 1, max: 2}"), "ds-1")


def test_a_run_recorded_before_a_field_existed_resumes_with_it_at_its_default(tmp_path: Path) -> None:
    import json

    from ray_jobs.config import ADDED_LATER

    registry.begin_attempt(cfg(tmp_path), {"address": "a"}, "ds-1")
    path = tmp_path / "runs" / "r" / "run.json"
    record = json.loads(path.read_text())
    for dotted in ADDED_LATER:  # as an older release wrote it
        section, _, key = dotted.partition(".")
        del record["config"][section][key]
    path.write_text(json.dumps(record))
    registry.check_compatible(cfg(tmp_path), "ds-1")
    with pytest.raises(registry.RunConflict, match="model:"):  # set otherwise, the field counts as ever
        registry.check_compatible(cfg(tmp_path, "model.quantization=4bit", "model.lora.r=4"), "ds-1")


def test_reusing_a_run_name_for_an_incompatible_training_is_refused(tmp_path: Path) -> None:
    registry.begin_attempt(cfg(tmp_path), {"address": "a"}, "ds-1")
    with pytest.raises(registry.RunConflict) as err:
        registry.check_compatible(cfg(tmp_path, "model.tiny.hidden_size=64", "cluster.num_workers=1"), "ds-2")
    text = str(err.value)
    assert "dataset: ds-1 -> ds-2" in text and "cluster.num_workers: 2 -> 1" in text and "model:" in text
    assert "--set name=" in text


def test_status_command_prints_attempts_heartbeat_and_final_model(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys
    import time

    c = cfg(tmp_path)
    registry.begin_attempt(c, {"address": "http://127.0.0.1:8265"}, "ds-1")
    registry.end_attempt(c, 1, "FAILED", "Ray job unbroken-r-train-001 ended FAILED: worker died\nmore")
    registry.begin_attempt(c, {"address": "http://127.0.0.1:8265"}, "ds-1")
    registry.end_attempt(c, 2, "SUCCEEDED", final_model="/x/final")
    beat = {"run": "r", "attempt": 2, "step": 30, "max_steps": 30, "last_step_at": time.time() - 5, "time": time.time(),
            "tokens_per_s": 1.5}  # fmt: skip
    (tmp_path / "runs" / "r" / "heartbeat.json").write_text(json.dumps(beat))

    out = subprocess.run([sys.executable, "-m", "unbroken", "status", "r", "--storage", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("run r: succeeded")
    first, second = (registry.submission_id(c.storage, "r", n) for n in (1, 2))
    assert f"#1 {first}  FAILED" in text and "worker died" in text and "more" not in text
    assert f"#2 {second}  SUCCEEDED" in text
    assert "incidents: none" in text and "heartbeat: step 30/30" in text and "final model: /x/final" in text

    missing = subprocess.run([sys.executable, "-m", "unbroken", "status", "nope", "--storage", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and missing.stderr.startswith("error: no run 'nope' under"), missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, "one line, no traceback"


def test_the_watchdog_reads_only_active_runs_registries_however_many_runs_finished(tmp_path: Path, monkeypatch) -> None:
    from ray_jobs.storage import write_json_atomic

    storage = str(tmp_path)
    for i in range(40):  # written before the index existed: the first look builds it
        write_json_atomic(f"{storage}/runs/done-{i:02d}/run.json", {"state": "succeeded", "attempts": []})
    write_json_atomic(f"{storage}/runs/old-active/run.json", {"state": "running", "attempts": []})
    assert registry.active_runs(storage) == ["old-active"]
    registry.save(storage, "new", RunRecord(name="new", state="submitted"))
    loads: list[str] = []
    real = registry.load
    monkeypatch.setattr(registry, "load", lambda s, run: loads.append(run) or real(s, run))
    assert registry.active_runs(storage) == ["new", "old-active"]
    assert sorted(loads) == ["new", "old-active"], "no finished run's registry is read"
    monkeypatch.undo()
    registry.save(storage, "new", RunRecord(name="new", state="succeeded"))
    assert registry.active_runs(storage) == ["old-active"]


@pytest.mark.parametrize("before", ["a new run", "a finished run started again"])
def test_a_watchdog_pass_inside_a_flows_save_never_drops_the_runs_marker(tmp_path: Path, monkeypatch, before) -> None:
    """The race CI once lost a run to: the flow's save had written the run's index marker but not yet its run.json
    when a watchdog pass listed the marker, read no record (or the finished one) and "healed" the index -- no watchdog
    looked at the run again. The marker goes only under the run's lease, which the flow holds while it saves."""
    c = cfg(tmp_path)
    registry.active_runs(c.storage)  # the index is built
    if before != "a new run":
        registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
        registry.end_attempt(c, 1, "FAILED", "boom")
        assert registry.active_runs(c.storage) == []
    seen: list[list[str]] = []
    real = registry.write_json_atomic

    def write_during_a_pass(url, *a, **k):
        if url.endswith("/run.json"):
            seen.append(registry.active_runs(c.storage))  # a watchdog's pass between the marker and run.json
        return real(url, *a, **k)

    monkeypatch.setattr(registry, "write_json_atomic", write_during_a_pass)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    monkeypatch.undo()
    assert seen == [[]], "the pass did not see a run it could not read yet"
    assert registry.active_runs(c.storage) == ["r"], "the next pass does"


def test_a_marker_left_by_a_crash_before_the_first_run_json_is_dropped(tmp_path: Path) -> None:
    from ray_jobs.storage import Layout, write_bytes_atomic

    storage = str(tmp_path)
    registry.active_runs(storage)
    write_bytes_atomic(f"{Layout(storage).active_index()}/gone", b"")  # its lease free: nobody is saving it
    assert registry.active_runs(storage) == []
    assert [p.name for p in Path(Layout(storage).active_index()).iterdir()] == [".built"]


def test_mark_running_takes_the_lease_once_not_once_a_poll(tmp_path: Path, monkeypatch) -> None:
    c = cfg(tmp_path)
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    taken: list[str] = []
    real = registry.leases.acquire
    monkeypatch.setattr(registry.leases, "acquire", lambda *a, **k: taken.append("lease") or real(*a, **k))
    assert all(registry.mark_running(c.storage, c.name, 1) for _ in range(5))
    assert taken == ["lease"] and registry.load(c.storage, c.name).state == "running"


def test_the_storage_clocks_probe_is_never_read_as_a_run_or_leaves_a_lease_behind(tmp_path: Path, monkeypatch) -> None:
    """The watchdog asks the storage's clock (a probe file written, its stamp read, the file removed) while another
    watchdog lists the active runs: that listing never takes the probe for a run, and no lease folder is made for
    one. The probe lives where nothing lists (``<storage>/probes``)."""
    from control.watchdog.observe import heartbeat_seen
    from ray_jobs import coordination
    from ray_jobs.storage import Layout

    c = cfg(tmp_path)
    registry.begin_attempt(c, {"address": "a"}, "ds-1")
    Path(Layout(c.storage).heartbeat("r")).write_text('{"run": "r", "attempt": 1, "time": 1, "max_steps": 9, '
                                                      '"last_step_at": 1, "schema_version": 1}')  # fmt: skip
    seen, real = [], coordination.modified_at

    def stamped_while_another_pass_lists(url: str) -> float:
        if "clock" in url:  # the probe is on storage right now
            seen.append((url, registry.active_runs(c.storage)))
        return real(url)

    monkeypatch.setattr(coordination, "modified_at", stamped_while_another_pass_lists)
    coordination._CLOCKS.clear()
    beat, age = heartbeat_seen(c.storage, "r", 1)
    assert beat is not None and age is not None
    ((probe, active),) = seen
    assert active == ["r"] and probe.startswith(Layout(c.storage).probes()), seen
    assert sorted(p.name for p in Path(c.storage, "runs").iterdir()) == ["r"], "no run folder, no lease, for a probe"
    assert not list(Path(Layout(c.storage).probes()).iterdir()), "the probe is removed"
