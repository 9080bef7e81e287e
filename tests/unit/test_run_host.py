"""The run host's parts that need no cluster (``fault_tolerance.run_host``, ray_jobs/host.py): one name per attempt,
the driver's ``--attach`` flag, and the finetune flow watching on under a re-attached driver -- or handing the run over
when its job failed indeed. The host itself, its driver killed, is proven on a real head:
``tests/chaos/test_watchdog_recovery.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from control.jobs import JobFailed
from ray_jobs.host import host_name
from tests.conftest import ROOT


def test_one_host_name_per_attempt_and_storage() -> None:
    a, b = "/s/runs/r/job-spec-001.json", "/s/runs/r/job-spec-002.json"
    assert host_name(a) == host_name(a) != host_name(b) != host_name("/t/runs/r/job-spec-001.json")
    assert host_name(a).startswith("unbroken-host-") and len(host_name(a)) == len("unbroken-host-") + 16


def test_the_driver_takes_attach_and_the_spec_in_any_order(monkeypatch) -> None:
    import ray_jobs.host
    import ray_jobs.job

    seen = {}
    cfg = SimpleNamespace(fault_tolerance=SimpleNamespace(run_host_orphan_s=300.0), hosted=False,
                          cluster=SimpleNamespace(gcs_ft=""))  # fmt: skip
    monkeypatch.setattr(ray_jobs.job, "job_spec", lambda prog, kind, argv: (None, cfg))
    monkeypatch.setattr(ray_jobs.host, "drive", lambda spec, train, argv, orphan_s, attach, off_head: seen.update(
        spec=spec, argv=argv, attach=attach, off_head=off_head) or {"result": {"metrics": {}, "checkpoint": None}})  # fmt: skip
    assert ray_jobs.job.main(["--attach", "--spec", "s.json"]) == 0
    assert seen == {"spec": "s.json", "argv": ["--spec", "s.json"], "attach": True, "off_head": False}


@pytest.mark.parametrize(("reattached", "handed_over"), [("sid-d2", False), (None, True)])
def test_the_flow_watches_on_under_a_re_attached_driver_or_hands_the_run_over(
    monkeypatch, tmp_path: Path, reattached: str | None, handed_over: bool
) -> None:
    import flows.finetune as finetune
    from ray_jobs.config import load_config

    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "name=r"])
    watched, over = [], []

    async def watch_job(handle, sid, cfg, attempt):
        watched.append(sid)
        if len(watched) == 1:
            raise JobFailed(f"Ray job {sid} ended FAILED")

    async def link(*a, **k):
        return None

    monkeypatch.setattr(finetune, "submit_job", lambda handle, sid, spec, cfg: sid)
    monkeypatch.setattr(finetune, "acreate_link_artifact", link)
    monkeypatch.setattr(finetune, "watch_job", watch_job)
    monkeypatch.setattr(finetune, "reattach_driver", lambda cfg, attempt, sid: reattached)
    monkeypatch.setattr(finetune, "hand_over", lambda cfg, attempt, address, e: over.append(str(e)))
    monkeypatch.setattr(finetune, "summarize", lambda cfg, dataset_id: {"summary": dataset_id})
    handle = SimpleNamespace(address="http://h:8265", dashboard_url="http://h:8265")
    staged = SimpleNamespace(dataset_id="ds-1")
    run = finetune._run_job(cfg, handle, staged, 1, "spec.json")  # ty: ignore[invalid-argument-type]
    if handed_over:
        with pytest.raises(JobFailed):
            asyncio.run(run)
        assert len(watched) == 1 and len(over) == 1
    else:
        assert asyncio.run(run) == {"summary": "ds-1"}
        assert watched[1] == "sid-d2" and not over


@pytest.mark.parametrize(
    ("run_host", "said", "status", "expected"),
    [
        (True, "UNBROKEN_HOST_STOP stopped", "SUCCEEDED", True),
        (True, "UNBROKEN_HOST_STOP none", "SUCCEEDED", False),
        (True, "Traceback ...\nRuntimeError: no cluster", "FAILED", "ClusterError"),
        (False, "", "", False),
    ],
    ids=["a host left: stopped", "none left", "the stop job failed: said", "no run host: nothing asked"],
)
def test_the_control_plane_stops_an_attempts_run_host_by_a_stop_job(
    monkeypatch, tmp_path: Path, run_host: bool, said: str, status: str, expected: object
) -> None:
    """Where a driver cannot stop its host (it is dead): a short job, ``--stop-host``, under a submission id of its
    own (never taken for a training job's), for the attempt's job spec; what it printed says whether a host was left."""
    from control import runhost
    from control.backends.base import ClusterError, ClusterHandle
    from control.jobsapi import JobView
    from ray_jobs.config import load_config
    from tests.conftest import tiny_overrides

    cfg = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(tmp_path, name="r", **{
        "fault_tolerance.run_host": run_host, "cluster.python": "/venv/bin/python"}))  # fmt: skip
    submitted = []
    monkeypatch.setattr(runhost, "submit", lambda handle, sid, module, spec, env=None, flags=(): submitted.append(
        (handle.python, sid, module, spec, flags)))  # fmt: skip
    monkeypatch.setattr(runhost.jobsapi, "read_job", lambda address, sid: JobView("ok", status))
    monkeypatch.setattr(runhost.jobsapi, "job_logs", lambda address, sid: f"starting\n{said}\n")
    handle = ClusterHandle("http://h:8265", "http://h:8265", False, "python")
    if expected == "ClusterError":
        with pytest.raises(ClusterError, match="stopping the run host of attempt 2: job .* ended FAILED"):
            runhost.stop_run_host(cfg, handle, 2)
    else:
        assert runhost.stop_run_host(cfg, handle, 2) is expected
    if not run_host:
        assert submitted == []
        return
    ((python, sid, module, spec, flags),) = submitted
    assert python == "/venv/bin/python" and module == "ray_jobs.job" and flags == ("--stop-host",)
    assert "-hoststop-002-" in sid and "-train-" not in sid and spec.endswith("job-spec-002.json")


def test_the_stop_flag_stops_the_host_and_reads_no_storage(monkeypatch, capsys) -> None:
    import ray_jobs.host
    import ray_jobs.job

    monkeypatch.setattr(ray_jobs.job, "job_spec", lambda *a: pytest.fail("the stop job reads no job spec"))
    monkeypatch.setattr(ray_jobs.host, "stop", lambda spec: f"stopped:{spec}")
    assert ray_jobs.job.main(["--spec", "s3://b/runs/r/job-spec-001.json", "--stop-host"]) == 0
    assert capsys.readouterr().out.strip().endswith("UNBROKEN_HOST_STOP stopped:s3://b/runs/r/job-spec-001.json")


@pytest.mark.parametrize(
    ("asked", "mark", "ours"),
    [
        ("unbroken-r-abc123-train-001", "unbroken-r-abc123-train-001", True),
        ("unbroken-r-abc123-train-001-d2", "unbroken-r-abc123-train-001", True),  # the host: the first driver's mark
        ("unbroken-r-abc123-train-001", "unbroken-r-abc123-train-001-d3", True),  # a re-attached driver
        ("unbroken-r-abc123-train-001-d2", "unbroken-r-abc123-train-001-d2", True),
        ("unbroken-r-abc123-train-001", "unbroken-r-abc123-train-002", False),  # another attempt
        ("unbroken-r-abc123-train-001", "unbroken-r-abc123-train-0010", False),
        ("unbroken-r-abc123-train-001", "unbroken-r-abc123-hoststop-001-9f2c1a", False),  # the stop job
        ("unbroken-r-abc123-train-001", "unbroken-r2-abc123-train-001", False),  # another run
    ],
)
def test_a_local_heads_processes_of_an_attempt_are_all_its_drivers_and_its_hosts(asked, mark, ours) -> None:
    """What a local head's backend counts as a job's processes (its evidence that a job is gone, and what it stops
    for certain): a re-attached driver's job is its attempt's -- the run host and its workers carry the first
    driver's mark."""
    from control.backends.localhost import attempt_marks

    assert attempt_marks(asked)(mark) is ours
