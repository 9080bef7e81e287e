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
    cfg = SimpleNamespace(fault_tolerance=SimpleNamespace(run_host=False, run_host_orphan_s=300.0))
    monkeypatch.setattr(ray_jobs.job, "job_spec", lambda prog, kind, argv: (None, cfg))
    monkeypatch.setattr(ray_jobs.host, "drive", lambda spec, train, argv, orphan_s, attach: seen.update(
        spec=spec, argv=argv, attach=attach) or {"result": {"metrics": {}, "checkpoint": None}})  # fmt: skip
    assert ray_jobs.job.main(["--attach", "--spec", "s.json"]) == 0
    assert seen == {"spec": "s.json", "argv": ["--spec", "s.json"], "attach": True}


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
