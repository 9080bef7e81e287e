"""s3:// storage for real: a moto S3 server over HTTP; staging, shard reads, and a whole run through it."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from ray_jobs.config import ClusterConfig, load_config
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA, tiny_overrides
from tests.integration.conftest import run_cli
from tests.procs import free_port
from tests.s3 import SECRET, make_bucket, moto_server

pytestmark = pytest.mark.integration
DEMO = str(ROOT / "configs" / "demo.yaml")
URI_SECRET = "UNBROKEN-URI-SECRET-123"  # the password of a tracking URI: never written, never shown
# the S3 keys (the default), and MLflow's retries for the job's client
PASSTHROUGH = [*ClusterConfig().env_passthrough, "MLFLOW_HTTP_REQUEST_MAX_RETRIES"]


@pytest.fixture(scope="module")
def bucket():
    with moto_server():
        root = make_bucket("unbroken-it")
        fs = fsspec.filesystem("s3")
        fs.put_file(str(SAMPLE_DATA), f"{root}/data/addition.jsonl")
        yield root


def test_stage_from_and_to_s3_then_read_shards_through_the_cache(bucket, tmp_path) -> None:
    cfg = load_config(
        DEMO,
        tiny_overrides(tmp_path, storage=f"{bucket}/stage-test", **{"data.train": f"{bucket}/data/addition.jsonl"}),
    )
    model = tmp_path / "model"
    build_builtin(cfg.model, 0, model)
    tok = load_tokenizer(str(model))
    first = stage(cfg.data, tok, str(model), cfg.storage)
    assert not first.cache_hit
    assert first.manifest_url == f"{bucket}/stage-test/datasets/{first.dataset_id}/manifest.json"
    assert first.manifest.sources["train"][0].url == f"{bucket}/data/addition.jsonl"
    again = stage(cfg.data, tok, str(model), cfg.storage)
    assert again.cache_hit and again.dataset_id == first.dataset_id

    entries = first.manifest.shards["train"]
    cold = ShardCache(cfg.storage, first.dataset_id, str(tmp_path / "cache"))
    for e in entries:
        cold.local_path(e)
    assert cold.misses == len(entries) and cold.bytes_from_storage == sum(e.bytes for e in entries)
    warm = ShardCache(cfg.storage, first.dataset_id, str(tmp_path / "cache"))
    for e in entries:
        warm.local_path(e)
    assert warm.counters() == {"hits": len(entries), "misses": 0, "bytes_from_storage": 0}


def test_a_whole_run_with_data_and_storage_on_s3(bucket, tmp_path, monkeypatch) -> None:
    """A whole run on S3, with credentials about: the S3 keys in the environment, and a password in the MLflow
    tracking URI (a closed port: MLflow fails at once, training goes on). No file the run writes (storage, the node's
    cache, tracker files), no Prefect record of it (parameters, logs, artifacts, states), no log of its Ray job and
    no line of the CLI holds either."""
    storage = f"{bucket}/runs-test"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, not after MLflow's minutes of retries
    extra = {"data.train": f"{bucket}/data/addition.jsonl", "tracking.tensorboard": "true",
             "tracking.mlflow.tracking_uri": f"http://alice:{URI_SECRET}@127.0.0.1:{free_port()}",
             "cluster.env_passthrough": f"[{', '.join(PASSTHROUGH)}]"}  # fmt: skip
    sets = tiny_overrides(tmp_path, name="s3run", storage=storage, **extra)
    r = run_cli("run", DEMO, *[a for kv in sets for a in ("--set", kv)])
    assert r.returncode == 0, r.explain()
    assert r.last_line == f"final model: {storage}/runs/s3run/final"

    fs = fsspec.filesystem("s3")
    files = fs.find(bucket.removeprefix("s3://"))
    assert any(p.endswith("runs/s3run/run.json") for p in files)
    assert any("/ray/s3run/checkpoint-step-" in p and p.endswith("manifest.json") for p in files)
    assert any("/runs/s3run/tensorboard/" in p for p in files), "the tracker's files are on storage too"
    reg = json.loads(fs.cat(f"{storage}/runs/s3run/run.json"))
    assert reg["state"] == "succeeded"
    shown = {
        "cli": r.stdout + r.stderr,
        **prefect_records("s3run"),
        **ray_job_logs(reg["attempts"][0]["submission_id"]),
    }
    written = {p: fs.cat(p).decode(errors="replace") for p in files} | local_files(tmp_path)
    assert [k for k, text in (written | shown).items() if SECRET in text or URI_SECRET in text] == []
    logs = "\n".join(v for k, v in shown.items() if k.startswith("logs"))
    assert "tracker mlflow failed to open" in logs and "alice:***@127.0.0.1" in logs, "the job asked MLflow"
    assert "credentials were not available" not in logs and "did not reach this job" not in logs, "with its password"

    from transformers import AutoModelForCausalLM

    local = tmp_path / "final"
    fs.get(f"{storage}/runs/s3run/final/", str(local) + "/", recursive=True)
    AutoModelForCausalLM.from_pretrained(local)


def local_files(root: Path) -> dict[str, str]:
    """Every file under ``root`` (the node's cache of the run's shards and model)."""
    return {str(p): p.read_bytes().decode(errors="replace") for p in root.rglob("*") if p.is_file()}


def prefect_records(run: str) -> dict[str, str]:
    """What the test's Prefect server holds of the flow runs of ``run``: their parameters and states, every log line
    (the job's forwarded ones among them) and artifact, and their task runs' states."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters as f

    out: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=f.FlowRunFilter(name=f.FlowRunFilterName(like_=run)))
        assert runs, f"no flow run of {run}"
        for fr in runs:
            logs, by_run = [], f.LogFilter(flow_run_id=f.LogFilterFlowRunId(any_=[fr.id]))
            while page := client.read_logs(log_filter=by_run, limit=200, offset=len(logs)):
                logs += page
            tasks = client.read_task_runs(flow_run_filter=f.FlowRunFilter(id=f.FlowRunFilterId(any_=[fr.id])))
            arts = client.read_artifacts(
                artifact_filter=f.ArtifactFilter(flow_run_id=f.ArtifactFilterFlowRunId(any_=[fr.id]))
            )
            out[f"flow run {fr.name}"] = fr.model_dump_json() + "".join(t.model_dump_json() for t in tasks)
            out[f"logs of {fr.name}"] = "\n".join(log.message for log in logs)
            out[f"artifacts of {fr.name}"] = "".join(a.model_dump_json() for a in arts)
    assert any(k.startswith("logs") and "[ray]" in v for k, v in out.items()), "the job's log was forwarded"
    return out


def ray_job_logs(submission_id: str) -> dict[str, str]:
    """The logs of the local head's session that ran the job: its driver's, its workers', Ray's own -- the runtime
    env agent's too, which would log every runtime_env it sets up whole (how a job's credentials reach it:
    ray_jobs/secrets.py) but for the warning level a local head unbroken starts logs at."""
    from control.backends.localhost import head_dir

    drivers = sorted(
        head_dir(8265).glob(f"session_*/logs/job-driver-{submission_id}.log"), key=lambda p: p.stat().st_mtime
    )
    assert drivers, f"no log of Ray job {submission_id}"
    return {
        f"ray {p.name}": p.read_bytes().decode(errors="replace") for p in drivers[-1].parent.rglob("*") if p.is_file()
    }


def test_watchdog_lease_on_s3_is_exclusive(bucket) -> None:
    """The lease's exclusive create is a conditional PUT (If-None-Match: *) on S3: one winner, fencing works."""
    from control import lease as leases
    from ray_jobs.coordination import create_exclusive

    storage = f"{bucket}/lease-test"
    assert create_exclusive(f"{storage}/claim", b"a") is True
    assert create_exclusive(f"{storage}/claim", b"b") is False
    first = leases.acquire(storage, "r", owner="a", ttl_s=60)
    assert first is not None and leases.acquire(storage, "r", owner="b") is None
    first.release()
    second = leases.acquire(storage, "r", owner="b", ttl_s=60)
    assert second is not None and second.generation == 2
    second.check()
