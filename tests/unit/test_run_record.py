"""The run record as a typed contract: a run.json written by an untyped release loads (migrated to the current
schema version) and writes back the same fields, an unknown field or a wrong value is refused naming the file and
the field, and a record from a newer release is refused rather than half-read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from control import registry
from control.records.run import RunRecord
from ray_jobs.contracts.base import RecordError
from ray_jobs.contracts.job_spec import AttemptInputs, JobSpec

# A run.json as the untyped registry wrote it (no schema_version): a run that failed once, was restarted by the
# watchdog, noted a lost node and succeeded.
V1 = {
    "name": "r", "created_at": 1795534983.0, "updated_at": 1795535100.0, "state": "succeeded",
    "config": {"name": "r", "fault_tolerance": {"max_restarts": 3}}, "dataset_id": "ds-1a2b",
    "cluster": {"address": "http://127.0.0.1:8285", "backend": "local", "mode": "local", "spec": {},
                "started_here": True},
    "attempts": [
        {"attempt": 1, "submission_id": "unbroken-r-train-001", "started_at": 1795534983.8, "started_by":
         "finetune-flow", "resume_from": None, "status": "FAILED", "ended_at": 1795535010.0, "message": "boom"},
        {"attempt": 2, "submission_id": "unbroken-r-train-002", "started_at": 1795535012.0, "started_by": "watchdog",
         "resume_from": "/s/ray/r/checkpoint-step-00000040", "status": "SUCCEEDED", "ended_at": 1795535090.0},
    ],
    "incidents": [
        {"kind": "job-failed", "detected_by": "finetune-flow", "detected_at": 1795535010.0, "attempt": 1,
         "failed_step": 57, "progress_steps": 57, "phase": None, "last_progress_at": 1795535009.0, "silent_s": 1.0,
         "detail": "Ray job ended FAILED", "error": {"type": "ActorDiedError", "message": "x", "kinds": ["ActorDiedError"]},
         "action": "restarted", "lost_steps": 17, "new_attempt": 2, "submission_id": "unbroken-r-train-002",
         "resumed_from": "/s/ray/r/checkpoint-step-00000040", "resumed_step": 40, "restarted_at": 1795535012.0,
         "reprovisioned": False, "first_new_step_at": 1795535020.0, "time_to_recover_s": 10.0, "downtime_s": 11.0},
        {"kind": "nodes-missing", "detected_by": "watchdog (cluster health)", "detected_at": 1795535030.0,
         "attempt": 2, "action": "noted", "detail": "nodes-missing: 2 of 3 nodes alive", "cleared_at": 1795535040.0},
    ],
    "restarts": 1, "manifest_url": "/s/datasets/ds-1a2b/manifest.json", "model_path": "/s/models/tiny",
    "parent": None, "score_manifest_url": "/s/datasets/ds-1a2b/manifest.json", "shape": {"attempt": 2, "nodes": 3},
    "final_model": "/s/runs/r/final",
}  # fmt: skip


def write(tmp_path: Path, tree: dict) -> str:
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps(tree))
    return str(tmp_path)


INPUTS = ("manifest_url", "model_path", "parent", "score_manifest_url")  # top-level fields before version 4


def test_a_record_of_the_untyped_release_loads_and_writes_back_the_same_fields(tmp_path: Path) -> None:
    storage = write(tmp_path, V1)
    reg = registry.load(storage, "r")
    assert reg.schema_version == RunRecord.SCHEMA == 4
    assert reg.current.resume_from.endswith("00000040") and reg.incidents[0].resumed_step == 40
    assert reg.open_incident() is None and not reg.active
    assert reg.inputs is not None and (reg.inputs.model_path, reg.inputs.parent) == ("/s/models/tiny", None)
    registry.save(storage, "r", reg)
    again = json.loads((tmp_path / "runs" / "r" / "run.json").read_text())
    assert again.pop("schema_version") == 4
    assert again.pop("updated_at") >= V1["updated_at"]
    # the attempt's inputs gathered into one part (version 4), every other field as it was
    assert again.pop("inputs") == {k: V1[k] for k in INPUTS if V1[k] is not None}
    assert again == {k: v for k, v in V1.items() if k != "updated_at" and k not in INPUTS}


def test_a_job_spec_of_version_1_reads_with_its_inputs_gathered(tmp_path: Path) -> None:
    tree = {"config": {}, "manifest_url": "m", "model_path": "p", "parent": "a", "resume_from": "c", "attempt": 2}
    spec = JobSpec.parse(tree, "job-spec-002.json")
    assert spec.inputs == AttemptInputs(manifest_url="m", model_path="p", parent="a")
    assert (spec.resume_from, spec.attempt, spec.schema_version) == ("c", 2, 2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"colour": "blue"}, "colour"),  # a field this version does not know
        ({"attempts": [V1["attempts"][0] | {"retries": 2}]}, "attempts.0.retries"),
        ({"incidents": [V1["incidents"][1] | {"acton": "noted"}]}, "incidents.0.acton"),
        ({"state": "paused"}, "state"),  # not a state
        ({"restarts": "one"}, "restarts"),
    ],
)
def test_a_bad_field_is_refused_naming_the_file_and_the_field(tmp_path: Path, change: dict, named: str) -> None:
    storage = write(tmp_path, V1 | change)
    with pytest.raises(RecordError) as err:
        registry.load(storage, "r")
    assert str(err.value).startswith(f"{tmp_path}/runs/r/run.json: ") and named in str(err.value)


def test_a_record_of_a_newer_release_is_refused(tmp_path: Path) -> None:
    storage = write(tmp_path, V1 | {"schema_version": 99})
    with pytest.raises(RecordError, match="schema_version 99 is newer than this unbroken reads"):
        registry.load(storage, "r")
