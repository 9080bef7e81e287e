"""The hand-over from the finetune flow to the watchdog, and the watchdog refusing to loop on a user error.

Real CLI run (real Ray head, real ephemeral Prefect): the job fails inside the workers on a user mistake the flow
cannot see before the cluster (a base-model folder whose config names an activation this transformers does not
have: the flow reads only its tokenizer; LoRA mistakes, by contrast, are refused before any cluster work). The flow
records the incident and fails; the watchdog flow then gives up at once with that reason, marks the run failed and
emits ``unbroken.run.gave-up``.
"""

from __future__ import annotations

import json

import pytest

from ray_jobs.config import load_config
from ray_jobs.model.builtin import build_builtin
from tests.conftest import ROOT, tiny_overrides
from tests.integration.conftest import read_registry, run_cli

pytestmark = pytest.mark.integration
DEMO = ROOT / "configs" / "demo.yaml"


def broken_model(tmp_path, storage) -> str:
    """The built-in model's folder with ``hidden_act`` set to an activation transformers does not know."""
    folder = tmp_path / "broken-model"
    build_builtin(load_config(DEMO, tiny_overrides(storage)).model, 0, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_act": "no_such_act"}))
    return str(folder)


def test_failed_job_is_handed_over_and_a_user_error_is_not_retried(tmp_path, asserting_events) -> None:
    from prefect.events.worker import EventsWorker

    from flows.watchdog import watchdog

    storage = tmp_path / "storage"
    sets = tiny_overrides(storage, name="bad-model", **{"model.name_or_path": broken_model(tmp_path, storage)})
    r = run_cli("run", str(DEMO), *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 1, r.explain()
    assert "JobFailed" in r.stderr, r.explain()

    reg = read_registry(storage, "bad-model")
    assert reg["state"] == "recovering", reg  # handed over, not given up by the flow
    [incident] = reg["incidents"]
    assert incident["detected_by"] == "finetune-flow" and incident["kind"] == "job-failed"
    assert incident["error"]["type"] == "KeyError", incident  # transformers' activation lookup
    assert "no_such_act" in incident["error"]["message"]

    outcomes = watchdog(str(storage))
    EventsWorker.drain_all()
    assert [(o["run"], o["action"]) for o in outcomes] == [("bad-model", "gave-up")], outcomes
    reg = read_registry(storage, "bad-model")
    assert reg["state"] == "failed" and reg["restarts"] == 0 and len(reg["attempts"]) == 1, reg
    assert "raised KeyError" in reg["reason"] and "restart would repeat" in reg["reason"]

    events = [e for c in asserting_events.all for e in c.events if e.event.startswith("unbroken.")]
    assert [(e.event, e.resource.id) for e in events] == [("unbroken.run.gave-up", "unbroken.run.bad-model")]
    assert events[0].payload["incident"]["error"]["type"] == "KeyError"

    status = run_cli("status", "bad-model", "--storage", str(storage))
    assert status.returncode == 0, status.explain()
    assert "run bad-model: failed" in status.stdout
    assert "job-failed (attempt 1, by finetune-flow): gave-up: the job raised KeyError" in status.stdout

    # A second pass has nothing to do: the run is no longer active.
    assert watchdog(str(storage)) == []
