"""A run with credentials in its config: nothing it writes holds them, the job it submits is given them in its
environment and has them back, and a watchdog restart finds them again (ray_jobs/secrets.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from control import registry
from control.backends.base import ClusterHandle
from control.jobs import write_job_spec
from control.records.run import Incident
from ray_jobs.config import job_spec, load_config
from ray_jobs.contracts.job_spec import AttemptInputs, JobSpec
from ray_jobs.secrets import CREDENTIALS_ENV, job_env
from tests.conftest import ROOT, made_manifest, tiny_overrides

PASSWORD = "UNIT-URI-SECRET-7"
URI = f"http://alice:{PASSWORD}@mlflow.example.com:5000"
MASKED = "http://alice:***@mlflow.example.com:5000"
HANDLE = ClusterHandle("http://127.0.0.1:1", "http://127.0.0.1:1", False, "python")


@pytest.fixture(autouse=True)
def _no_credentials_here(monkeypatch):
    """This process starts without UNBROKEN_CREDENTIALS (a test that sets it has it undone)."""
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)


def cfg(tmp_path: Path):
    return load_config(ROOT / "configs" / "demo.yaml",
                       tiny_overrides(tmp_path / "storage", name="r", **{"tracking.mlflow.tracking_uri": URI}))  # fmt: skip


INPUTS = AttemptInputs(manifest_url="m", model_path="p")


def files_under(root: Path) -> dict[str, str]:
    return {str(p): p.read_text(errors="replace") for p in root.rglob("*") if p.is_file()}


def first_attempt(tmp_path: Path):
    c = cfg(tmp_path)
    registry.begin_attempt(
        c, {"address": "http://127.0.0.1:1"}, "ds-1", INPUTS, job_spec=lambda n: write_job_spec(c, n, INPUTS)
    )
    return c


def test_the_run_record_and_job_spec_hold_the_uri_masked(tmp_path: Path) -> None:
    c = first_attempt(tmp_path)
    written = files_under(tmp_path / "storage")
    assert written and not [p for p, text in written.items() if PASSWORD in text]
    assert json.loads(Path(c.storage, "runs", "r", "run.json").read_text())["config"]["tracking"]["mlflow"] == {
        "tracking_uri": MASKED, "experiment": None}  # fmt: skip
    registry.check_compatible(cfg(tmp_path), "ds-1")  # the masked record is no change of config


def test_a_password_with_a_slash_a_question_mark_a_hash_or_a_quote_is_written_masked_and_comes_back(
    tmp_path: Path, monkeypatch
) -> None:
    """SQLAlchemy reads a database password up to the first '@', '/', '?', '#' and quotes included: such an MLflow
    URI is masked in the run record and the job spec like any other, and a job given the credentials has it whole."""
    odd = "p/w?x#y'z\"9"
    uri = f"postgresql+psycopg2://mlflow:{odd}@db.example.com:5432/mlflow?sslmode=require"
    c = load_config(ROOT / "configs" / "demo.yaml",
                    tiny_overrides(tmp_path / "storage", name="r", **{"tracking.mlflow.tracking_uri": uri}))  # fmt: skip
    registry.begin_attempt(
        c, {"address": "http://127.0.0.1:1"}, "ds-1", INPUTS, job_spec=lambda n: write_job_spec(c, n, INPUTS)
    )
    written = files_under(tmp_path / "storage")
    assert written and not [p for p, text in written.items() if "p/w?x#y" in text or "x#y'z" in text]
    monkeypatch.setenv(CREDENTIALS_ENV, job_env(c.model_dump())[CREDENTIALS_ENV])
    spec = next(p for p in written if "job-spec-" in p)
    assert job_spec("ray_jobs.job", JobSpec, ["--spec", spec])[1].tracking.mlflow.tracking_uri == uri


def test_the_flow_submits_the_job_with_the_credentials_in_its_environment(tmp_path: Path, monkeypatch) -> None:
    import tasks.jobs

    seen = {}
    monkeypatch.setattr(
        tasks.jobs, "submit", lambda handle, sid, module, spec, env=None, code=None: seen.update(env=env) or sid
    )
    tasks.jobs.submit_job.fn(HANDLE, "sid", "spec.json", cfg(tmp_path))
    assert seen["env"] == {CREDENTIALS_ENV: URI}


def test_the_job_reveals_its_config_from_its_environment_or_says_what_it_lacks(tmp_path, monkeypatch, caplog) -> None:
    url = write_job_spec(cfg(tmp_path), 1, INPUTS)
    monkeypatch.setenv(CREDENTIALS_ENV, URI)
    _, given = job_spec("ray_jobs.job", JobSpec, ["--spec", url])
    assert given.tracking.mlflow.tracking_uri == URI
    monkeypatch.delenv(CREDENTIALS_ENV)
    with caplog.at_level(logging.WARNING):
        _, given = job_spec("ray_jobs.job", JobSpec, ["--spec", url])
    assert given.tracking.mlflow.tracking_uri == MASKED
    assert "the credentials of tracking.mlflow.tracking_uri did not reach this job" in caplog.text


def test_a_command_line_override_is_a_masked_parameter_and_the_config_has_it_back(tmp_path, monkeypatch) -> None:
    from ray_jobs.secrets import export_credentials

    monkeypatch.setenv(CREDENTIALS_ENV, "")  # export_credentials sets it: undone after the test
    overrides = export_credentials(tiny_overrides(tmp_path, **{"tracking.mlflow.tracking_uri": URI}))
    assert PASSWORD not in " ".join(overrides)
    assert load_config(ROOT / "configs" / "demo.yaml", overrides).tracking.mlflow.tracking_uri == URI


@pytest.mark.parametrize("source", ["watchdog's environment", "previous job", "nowhere"])
def test_a_watchdog_restart_submits_the_credentials_it_can_find(tmp_path, monkeypatch, caplog, source) -> None:
    from control.watchdog import credentials, restart

    first_attempt(tmp_path)
    registry.end_attempt(cfg(tmp_path), 1, "FAILED", "boom", state="recovering")
    if source == "watchdog's environment":
        monkeypatch.setenv(CREDENTIALS_ENV, URI)
    previous = {CREDENTIALS_ENV: URI, "UNBROKEN_SUBMISSION": "x"} if source == "previous job" else None
    asked, submitted = [], {}
    monkeypatch.setattr(credentials.jobsapi, "job_env", lambda address, sid, *a: asked.append(sid) or previous)
    monkeypatch.setattr(
        restart, "submit", lambda handle, sid, module, spec, env=None, code=None: submitted.update(env=env) or sid
    )
    reg = registry.load(str(tmp_path / "storage"), "r")  # what a watchdog has: the record alone
    reg.incidents.append(Incident(kind="job-failed", detected_by="watchdog", detected_at=0.0, attempt=1))
    lease = SimpleNamespace(check=lambda: None, kept=contextlib.nullcontext)
    with caplog.at_level(logging.WARNING):
        restart._resubmit(reg.cfg(), reg, reg.open_incident(), HANDLE, lease)

    assert submitted["env"] == ({} if source == "nowhere" else {CREDENTIALS_ENV: URI})
    assert asked == ([] if source == "watchdog's environment" else [registry.submission_id(reg.cfg().storage, "r", 1)])
    if source == "nowhere":
        assert "the credentials of tracking.mlflow.tracking_uri are not available here" in caplog.text
    assert not [p for p, text in files_under(tmp_path / "storage").items() if PASSWORD in text]


def test_a_recorded_cluster_address_is_revealed_where_it_is_used(tmp_path, monkeypatch) -> None:
    from control.backends import handle_from_record

    c = load_config(ROOT / "configs" / "demo.yaml",
                    tiny_overrides(tmp_path / "storage", name="r", **{"cluster.address": "https://u:pw-123@ray.example.com"}))  # fmt: skip
    registry.begin_attempt(c, {"address": c.cluster.address, "backend": "address"}, "ds-1")
    reg = registry.load(c.storage, "r")
    assert reg.cluster.address == "https://u:***@ray.example.com" == handle_from_record(reg.cluster).address
    monkeypatch.setenv(CREDENTIALS_ENV, "https://u:pw-123@ray.example.com")
    assert reg.cluster.url() == "https://u:pw-123@ray.example.com" == handle_from_record(reg.cluster).address
    assert reg.cfg().cluster.address == "https://u:pw-123@ray.example.com"


def test_trackers_model_card_and_checkpoint_state_show_the_config_masked(tmp_path: Path) -> None:
    from ray_jobs.checkpoint.state import LoopState, loop_state_file
    from ray_jobs.train.export import model_card
    from ray_jobs.train.tracking import run_info
    from ray_jobs.train.tracking.mlflow import run_links, tracking_uri

    c = cfg(tmp_path)
    assert run_info(c).params["tracking.mlflow.tracking_uri"] == MASKED  # MLflow params, W&B config
    assert run_links(URI, "e", "1", "abc")["url"].startswith(MASKED + "/#/experiments/1")  # tracking.json, artifact
    card = model_card(c, made_manifest(dataset_id="ds-1"), LoopState(), None)
    state = loop_state_file(LoopState(), SimpleNamespace(state_dict=dict), None, c, 2, [])
    assert PASSWORD not in card + json.dumps(state) and MASKED in card
    with pytest.raises(ValueError, match="its credentials were not available here"):
        tracking_uri(c.tracking.mlflow.model_copy(update={"tracking_uri": MASKED}), c.storage)


def test_staging_writes_a_source_url_masked_and_still_finds_its_hash(tmp_path: Path) -> None:
    from ray_jobs.data.fingerprint import Source, SourceIndex
    from ray_jobs.data.records import Reject

    src = Source(f"https://u:{PASSWORD}@data.example.com/d.jsonl", 10, "etag-1", "sha")
    SourceIndex(str(tmp_path)).remember(src)
    assert SourceIndex(str(tmp_path)).lookup(Source(src.url, 10, "etag-1")) == "sha"
    assert PASSWORD not in json.dumps(Reject(src.url, 2, "missing field 'target'").to_json())
    assert not [p for p, text in files_under(tmp_path).items() if PASSWORD in text]


def test_errors_that_quote_a_uri_are_masked_when_made_and_survive_pickling() -> None:
    from control.backends.base import ClusterError
    from control.jobs import ClusterLost
    from ray_jobs.data.sources import StagingError

    for kind in (ClusterError, ClusterLost, StagingError):
        e = kind("http://u:pw@h:8265 does not answer")
        assert str(e) == "http://u:***@h:8265 does not answer"
        assert str(pickle.loads(pickle.dumps(e))) == str(e), "Ray ships a worker's exception pickled"


def test_storage_with_credentials_is_refused_naming_storage(tmp_path) -> None:
    from ray_jobs.config import ConfigError

    for storage in ("https://u:p@host/runs", "s3://bucket/runs?X-Amz-Security-Token=abc"):
        with pytest.raises(ConfigError, match="storage: must not carry credentials"):
            load_config(ROOT / "configs" / "demo.yaml", [f"storage={storage}"])


def test_a_dataset_event_names_its_source_masked_and_the_flow_reads_it_whole(tmp_path, monkeypatch) -> None:
    from control.sources import SourceRefused
    from flows.params import run_config

    source = f"https://u:{PASSWORD}@data.example.com/sets/new.jsonl"
    overrides = tiny_overrides(tmp_path, **{"data.train": source.replace("new", "old")})
    monkeypatch.setenv(CREDENTIALS_ENV, source)  # the serving process's (deployments/serve.py)
    masked = "https://u:***@data.example.com/sets/new.jsonl"
    assert run_config(str(ROOT / "configs" / "demo.yaml"), overrides, masked).data.train == source
    with pytest.raises(SourceRefused) as refused:
        run_config(str(ROOT / "configs" / "demo.yaml"), overrides, source.replace("/sets/", "/other/"))
    assert PASSWORD not in str(refused.value)
