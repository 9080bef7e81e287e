"""The hand-over from the finetune flow to the watchdog, and the watchdog refusing to loop on a user error.

Real CLI run (real Ray head, real ephemeral Prefect): the job fails inside the workers with a config mistake
(LoRA target modules the model does not have). The flow records the incident and fails; the watchdog flow then
gives up at once with that reason, marks the run failed and emits ``unbroken.run.gave-up``.
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_registry, run_cli

pytestmark = pytest.mark.integration


def test_failed_job_is_handed_over_and_a_user_error_is_not_retried(tmp_path, asserting_events) -> None:
    from prefect.events.worker import EventsWorker

    from flows.watchdog import watchdog

    storage = tmp_path / "storage"
    sets = tiny_overrides(storage, name="bad-lora", **{"model.lora.target_modules": "[no_such_proj]"})
    r = run_cli("run", str(ROOT / "configs" / "demo.yaml"), *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 1, r.explain()
    assert "JobFailed" in r.stderr, r.explain()

    reg = read_registry(storage, "bad-lora")
    assert reg["state"] == "recovering", reg  # handed over, not given up by the flow
    [incident] = reg["incidents"]
    assert incident["detected_by"] == "finetune-flow" and incident["kind"] == "job-failed"
    assert "ValueError" in incident["error"]["kinds"], incident  # peft's NoMatchingPeftModuleError
    assert "no_such_proj" in incident["error"]["message"]

    outcomes = watchdog(str(storage))
    EventsWorker.drain_all()
    assert [(o["run"], o["action"]) for o in outcomes] == [("bad-lora", "gave-up")], outcomes
    reg = read_registry(storage, "bad-lora")
    assert reg["state"] == "failed" and reg["restarts"] == 0 and len(reg["attempts"]) == 1, reg
    assert "raised NoMatchingPeftModuleError" in reg["reason"] and "restart would repeat" in reg["reason"]

    events = [e for c in asserting_events.all for e in c.events if e.event.startswith("unbroken.")]
    assert [(e.event, e.resource.id) for e in events] == [("unbroken.run.gave-up", "unbroken.run.bad-lora")]
    assert events[0].payload["incident"]["error"]["type"] == "NoMatchingPeftModuleError"

    status = run_cli("status", "bad-lora", "--storage", str(storage))
    assert status.returncode == 0, status.explain()
    assert "run bad-lora: failed" in status.stdout
    assert (
        "job-failed (attempt 1, by finetune-flow): gave-up: the job raised NoMatchingPeftModuleError" in status.stdout
    )

    # A second pass has nothing to do: the run is no longer active.
    assert watchdog(str(storage)) == []
