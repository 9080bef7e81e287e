"""The flow's side of the control plane, without a cluster: what its watch does with blips, plumbing errors and
cancels; that an attempt is recorded only once the run fits its cluster; that a run never gets a second job in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from control import jobs, registry
from control.backends.base import ClusterHandle
from control.jobsapi import JobView
from ray_jobs.config import load_config
from tests.conftest import ROOT, made_manifest, tiny_overrides

HANDLE = ClusterHandle("http://127.0.0.1:1", "http://127.0.0.1:1", False, "python")


def cfg(storage: Path, **extra):
    return load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(storage, name="r", **extra))


@pytest.fixture
def api(monkeypatch):
    """The Jobs API as a script of views, one per poll (the last one repeats); no log tail."""
    script: list[JobView] = []

    def read_job(address, sid, timeout_s=10.0):
        return script.pop(0) if len(script) > 1 else script[0]

    async def no_tail(*a):
        return None

    monkeypatch.setattr(jobs.jobsapi, "read_job", read_job)
    monkeypatch.setattr(jobs, "STATUS_POLL_S", 0.01)
    monkeypatch.setattr(jobs.LogForwarder, "follow", no_tail)
    monkeypatch.setattr(jobs.jobsapi, "job_logs", lambda *a, **k: None)
    return script


def watch(**kw):
    return asyncio.run(jobs.watch(HANDLE, "unbroken-r-train-001", poll_s=0.01, **kw))


def test_a_blip_shorter_than_the_confirmation_window_does_not_end_the_watch(api) -> None:
    api += [JobView("unknown", why="HTTP 502")] * 20 + [JobView("ok", "RUNNING"), JobView("ok", "SUCCEEDED")]
    assert watch(confirm_s=30) == "SUCCEEDED"


def test_a_cluster_silent_for_the_whole_window_is_lost(api) -> None:
    api += [JobView("unknown", why="ConnectionError: refused")]
    with pytest.raises(jobs.ClusterLost, match="stopped answering"):
        watch(confirm_s=0.2)


def test_a_running_job_whose_drivers_node_is_dead_ends_the_watch_for_a_re_attach(api, monkeypatch) -> None:
    """A head restarted under GCS fault tolerance keeps a job whose driver died with it RUNNING: the watch asks
    ``driver_gone`` of a running job (every DRIVER_CHECK_S) and, told so, ends as for a failed job -- the flow then
    re-attaches a driver. Asked nothing of a job that is not running; without the callback, the watch goes on."""
    monkeypatch.setattr(jobs, "DRIVER_CHECK_S", 0.01)
    api += [JobView("ok", "PENDING"), *[JobView("ok", "RUNNING", driver_node="n0")] * 3, JobView("ok", "SUCCEEDED")]
    asked: list[str] = []

    def gone(view: JobView) -> bool:
        asked.append(view.status)
        return len(asked) == 2

    with pytest.raises(jobs.JobFailed, match="its driver's node is dead"):
        watch(driver_gone=gone)
    assert asked == ["RUNNING", "RUNNING"]
    api[:] = [*[JobView("ok", "RUNNING", driver_node="n0")] * 3, JobView("ok", "SUCCEEDED")]
    assert watch() == "SUCCEEDED"


def test_errors_of_the_watchs_own_plumbing_never_end_it(api) -> None:
    api += [JobView("ok", "RUNNING")] * 5 + [JobView("ok", "SUCCEEDED")]
    calls = []

    async def broken_progress(status):
        calls.append(status)
        raise OSError("artifact API: 503")

    assert watch(on_poll=broken_progress) == "SUCCEEDED"
    assert len(calls) == 6


def test_the_log_lines_the_stream_has_not_delivered_when_the_job_ends_come_from_one_read_of_the_log(
    monkeypatch,
) -> None:
    """Ray's log stream closes ~2-3 s after a job ended; the watch does not wait for it but reads the whole log once
    and forwards exactly the lines the stream had not (each line once, in order)."""
    logged = []

    class Log:
        def info(self, fmt, line, extra=None):
            logged.append(line)

    fwd = jobs.LogForwarder("http://127.0.0.1:1", "sid", Log())
    fwd._forward(["a", "", "b"], 0)  # what the stream delivered (a blank line counts, is not forwarded)
    fwd._forward(["b", "c"], 2)  # a re-opened stream repeats what was seen
    monkeypatch.setattr(jobs.jobsapi, "job_logs", lambda *a, **k: "a\n\nb\nc\n\x1b[36md\x1b[0m\ne\n")

    async def finish():
        follower = asyncio.create_task(asyncio.sleep(3600))
        await fwd.finish(follower)
        return follower.cancelled()

    assert asyncio.run(finish()), "the stream is not waited for"
    assert logged == ["a", "b", "c", "d", "e"]


def test_only_a_cancel_stops_the_job(api, monkeypatch) -> None:
    api += [JobView("ok", "RUNNING")]
    stopped = []
    monkeypatch.setattr(jobs, "stop_and_wait", lambda address, sid, wait_s=60: stopped.append(sid) or True)

    async def boom(status):
        raise KeyboardInterrupt  # what a cancel/termination looks like in the flow's process

    with pytest.raises(KeyboardInterrupt):
        watch(on_poll=boom)
    assert stopped == ["unbroken-r-train-001"]

    async def crash(status):
        raise MemoryError  # the flow's own failure: the job trains on, the watchdog adopts it

    stopped.clear()
    api[:] = [JobView("ok", "RUNNING")]
    monkeypatch.setattr(jobs, "_Watch", _RaisingWatch)
    with pytest.raises(MemoryError):
        asyncio.run(jobs.watch(HANDLE, "unbroken-r-train-001", poll_s=0.01, on_poll=crash))
    assert stopped == []


class _RaisingWatch(jobs._Watch):
    def warn(self, key, message):  # let the on_poll error through, as an unexpected failure of the watch would be
        raise MemoryError


def test_a_stop_that_cannot_be_verified_is_not_taken_for_one(monkeypatch) -> None:
    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: JobView("unknown", why="ReadTimeout"))
    with pytest.raises(jobs.StopUnverified, match="cannot tell whether Ray job x still runs"):
        jobs.stop_and_wait("http://127.0.0.1:1", "x")
    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: JobView("missing", why="no such job"))
    assert jobs.stop_and_wait("http://127.0.0.1:1", "x") is False


def test_a_sync_caller_waits_through_the_same_watch_with_or_without_a_running_loop(api, monkeypatch) -> None:
    """``run_to_end`` (a sync task: staging on the cluster) is ``watch`` itself: the same polls and blips rule; from
    inside a running loop (a sync task called from the async finetune flow) it runs beside it."""
    script = [JobView("unknown", why="HTTP 502"), JobView("ok", "RUNNING"), JobView("ok", "SUCCEEDED")]
    api += script
    assert jobs.run_to_end(HANDLE, "unbroken-stage-1", confirm_s=30) == "SUCCEEDED"

    async def inside_a_flow():
        api[:] = [*script[:2], JobView("ok", "FAILED", "boom")]
        with pytest.raises(jobs.JobFailed, match="ended FAILED: boom"):
            jobs.run_to_end(HANDLE, "unbroken-stage-2", confirm_s=30)
        return "done"

    assert asyncio.run(inside_a_flow()) == "done"


def test_a_submission_already_known_to_the_cluster_is_not_made_twice_and_one_it_cannot_tell_is_refused(
    monkeypatch,
) -> None:
    monkeypatch.setattr(jobs, "jobs_client", lambda address: pytest.fail("no submission expected"))
    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: JobView("ok", "RUNNING"))
    assert jobs.submit(HANDLE, "unbroken-r-train-001", "ray_jobs.job", "spec.json") == "unbroken-r-train-001"
    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: JobView("unknown", why="ReadTimeout"))
    with pytest.raises(jobs.ClusterError, match="cannot tell whether Ray job unbroken-r-train-001 was submitted"):
        jobs.submit(HANDLE, "unbroken-r-train-001", "ray_jobs.job", "spec.json")


def test_a_submission_that_never_answers_is_given_up_on(monkeypatch) -> None:
    import threading

    release = threading.Event()

    class Hung:
        def submit_job(self, **job):
            release.wait(10)  # the SDK's requests have no timeout of their own

    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: JobView("missing", why="no such job"))
    monkeypatch.setattr(jobs, "jobs_client", lambda address: Hung())
    monkeypatch.setattr(jobs, "SUBMIT_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(jobs.ClusterError, match="no answer within 0.2s"):
            jobs.submit(HANDLE, "unbroken-r-train-001", "ray_jobs.job", "spec.json")
    finally:
        release.set()


def test_a_second_attempt_is_refused_while_one_is_in_flight(tmp_path: Path) -> None:
    c = cfg(tmp_path / "storage")
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    with pytest.raises(registry.RunBusy, match="attempt 1 .* is in flight"):
        registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1")
    registry.end_attempt(c, 1, "FAILED", "boom")
    assert registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1") == 2


def test_the_job_spec_is_written_under_the_lease_only_by_the_attempt_that_wins(tmp_path: Path) -> None:
    """A second flow refused as busy never writes a job spec (it would overwrite the running attempt's); the spec of
    the attempt that is recorded exists before the record says it was submitted."""
    c = cfg(tmp_path / "storage")
    written = []

    def spec(attempt: int) -> None:
        assert registry.load(c.storage, c.name) is None or len(registry.load(c.storage, c.name).attempts) < attempt
        written.append(attempt)

    assert registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1", job_spec=spec) == 1
    with pytest.raises(registry.RunBusy):
        registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1", job_spec=spec)
    assert written == [1], "the refused flow wrote no job spec"


def test_hooks_act_only_on_the_attempt_their_flow_run_started(tmp_path: Path) -> None:
    """A queued duplicate of a run (same name, waiting on the series' slot) started no attempt: its cancel or crash
    finds nothing of its own, never the first flow run's attempt."""
    c = cfg(tmp_path / "storage")
    registry.begin_attempt(c, {"address": "http://x:8265"}, "ds-1", flow_run_id="first")
    reg = registry.load(c.storage, c.name)
    assert registry.attempt_of_flow_run(reg, "first").attempt == 1
    assert registry.attempt_of_flow_run(reg, "queued-duplicate") is None


def test_a_watchdog_pass_while_the_fit_is_checked_finds_nothing_to_do(tmp_path: Path, monkeypatch) -> None:
    import flows.finetune as flow
    from control.watchdog import check_run
    from tasks.stage import Staged

    c = cfg(tmp_path / "storage")
    seen = {}

    def does_not_fit(cfg, handle, manifest):
        seen["active"] = registry.active_runs(c.storage)
        seen["outcome"] = check_run(c.storage, c.name)
        raise RuntimeError("the run cannot start: not enough CPUs")

    monkeypatch.setattr(flow, "check_cluster_fits", does_not_fit)
    (tmp_path / "m.json").write_text(made_manifest(train_shards=0).model_dump_json())
    staged = Staged(dataset_id="ds-1", manifest_url=str(tmp_path / "m.json"), cache_hit=False, counts={})
    with pytest.raises(RuntimeError, match="not enough CPUs"):
        asyncio.run(
            flow._train(
                c, HANDLE, staged, flow.Lineage("builtin", "builtin", None, {"manifest_url": staged.manifest_url})
            )
        )
    assert seen["active"] == [] and seen["outcome"].action == "inactive"
    assert registry.load(c.storage, c.name) is None  # a run that does not fit leaves no attempt behind


def test_a_dataset_event_naming_a_secret_file_is_refused_before_anything_is_read(
    tmp_path: Path, asserting_events
) -> None:
    from prefect.events.worker import EventsWorker

    from control.sources import SourceRefused
    from flows.finetune import finetune

    overrides = tiny_overrides(tmp_path / "storage", name="served")
    with pytest.raises(SourceRefused, match="data.allowed_sources"):
        asyncio.run(finetune.fn(str(ROOT / "configs" / "demo.yaml"), overrides, "file:///etc/passwd"))
    EventsWorker.drain_all()
    events = [e for c in asserting_events.all for e in c.events]
    assert [e.event for e in events] == ["unbroken.dataset.rejected"]
    assert not (tmp_path / "storage").exists(), "nothing staged, nothing written"


def test_a_machine_without_a_ray_token_yet_probes_a_head_as_unanswered_instead_of_raising(monkeypatch) -> None:
    """A fresh machine has no ~/.ray/auth_token until the first local head generates it: the probe that decides
    whether a head is already up must say "no answer", not raise."""
    from ray.exceptions import AuthenticationError

    from control import jobsapi, rayapi

    def no_token():
        raise AuthenticationError("Token authentication is enabled but Ray couldn't find an authentication token")

    monkeypatch.setattr(rayapi, "headers", no_token)
    why = jobsapi.unanswered("http://127.0.0.1:1")
    assert why is not None and "no Ray auth token" in why
    assert jobsapi.read_job("http://127.0.0.1:1", "unbroken-r-train-001").api == "unknown"


def test_a_job_ships_the_ray_jobs_package_only_wherever_unbroken_is_installed(tmp_path: Path, monkeypatch) -> None:
    """Installed by a plain ``pip install .`` (no checkout), the folder around the code is site-packages: a job took
    it whole as its working directory. It ships the one package a job imports (``ray_jobs``) instead."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    sent = {}

    class Recorder:
        def submit_job(self, **job):
            sent.update(job)

    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: JobView("missing", why="no such job"))
    monkeypatch.setattr(jobs, "jobs_client", lambda address: Recorder())
    jobs.submit(HANDLE, "unbroken-r-train-001", "ray_jobs.job", "spec.json")
    env = sent["runtime_env"]
    assert "working_dir" not in env and env["py_modules"] == [str(ROOT / "ray_jobs")], env

    import shutil

    source = tmp_path / "unbroken"  # a copy of the project (a build writes build/ into its source folder)
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("flows", "tasks", "control", "ray_jobs", "deployments", "unbroken"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site-packages"  # unbroken as a plain install puts it, beside nothing of its own
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    pip += ["--target", str(target), str(source)]
    subprocess.run(pip, check=True, capture_output=True, cwd=tmp_path)
    probe = "import control.jobcode as j; print(j.job_code())"
    bare = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    found = subprocess.run([sys.executable, "-c", probe], env=bare, capture_output=True, text=True, cwd=tmp_path)
    shipped = Path(found.stdout.strip())
    assert shipped == target / "ray_jobs", found.stdout + found.stderr
    assert (shipped / "job.py").exists() and not (shipped / "torch").exists()
