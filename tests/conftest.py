"""Shared test setup: an isolated Prefect home, no telemetry, and small helpers to build configs."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.prefect_server import IDLE_SERVICES

# per-tier wall time, CPU use and the slowest tests, printed and written; make test's and make test-full's tests
pytest_plugins = ["tests.suite_report", "tests.tiers"]

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = ROOT / "configs" / "data" / "addition.jsonl"

# Before Prefect is imported anywhere: an ephemeral server with its own database, no analytics.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="unbroken-test-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("UNBROKEN_CACHE", tempfile.mkdtemp(prefix="unbroken-test-cache-"))  # check's remembered probes
os.environ.setdefault("UNBROKEN_VERBOSE", "1")  # the CLI's runs show the job logs the tests read (quiet: a test's own)
for _service in IDLE_SERVICES:  # no ephemeral server here serves deployments, schedules or automations
    os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{_service}_ENABLED", "false")


def tiny_overrides(root: Path, **extra: object) -> list[str]:
    """``--set`` overrides for a fast run of the demo config on a private storage folder under ``root``
    (``storage=...`` in ``extra`` puts storage elsewhere, e.g. on s3; the node cache stays under ``root``)."""
    base = {
        "name": "t",
        "storage": str(root),
        "data.cache_dir": str(root / "_node_cache"),
        "model.tiny.hidden_size": 32,
        "model.tiny.num_layers": 1,
        "model.tiny.intermediate_size": 64,
        "train.max_steps": 30,
        "train.eval_every_steps": 10,
        "train.log_every_steps": 5,
        "checkpoint.every_steps": 10,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path / "storage"


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def asserting_events():
    """Prefect events emitted in this process are recorded (``AssertingEventsClient.all``) instead of sent;
    call ``EventsWorker.drain_all()`` before looking."""
    from prefect.events.clients import AssertingEventsClient
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # a worker started earlier in the session keeps its old client: stop it
    EventsWorker.set_client_override(AssertingEventsClient)
    AssertingEventsClient.reset()
    yield AssertingEventsClient
    EventsWorker.drain_all()
    EventsWorker.set_client_override(None)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained chat model (fp32 HF folder; see tests/models.py)."""
    from tests.models import smollm2 as build

    return build()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> tuple[str, Path]:
    """The chaos config trained once, uninterrupted, for the whole session (tests/chaos/harness.uninterrupted_run):
    (final-weights hash, row trace folder) that the chaos, multinode and launcher scenarios compare against."""
    from tests.chaos.harness import uninterrupted_run

    return uninterrupted_run(tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="session")
def shared_prefect(tmp_path_factory):
    """One real Prefect server for every CLI run and flow of the session (tests/prefect_server.py), exported as
    ``PREFECT_API_URL``; the integration and chaos packages use it (their conftest), unit tests keep in-process ones.
    Lean: no test here serves deployments or automations (tests/integration/test_served.py has its own server)."""
    from tests.prefect_server import serving

    with serving(tmp_path_factory.mktemp("prefect-shared"), environ=True, lean=True) as server:
        yield server


def made_manifest(train_shards: int = 4, dataset_id: str = "ds-x", seq_len: int = 32):
    """A dataset manifest as staging writes it, for tests that need only its shape (no shard is read)."""
    from ray_jobs.contracts.dataset import Counts, DatasetManifest, Shard, TokenizerInfo

    def shard(split: str, i: int) -> Shard:
        return Shard(file=f"{split}-{i:05d}.parquet", rows=1, bytes=1, sha256="0" * 64)

    return DatasetManifest(dataset_id=dataset_id, staging_version=3, seq_len=seq_len, sources={}, counts=Counts(),
                           tokenizer=TokenizerInfo(name_or_path="builtin", fingerprint="f", vocab_size=64,
                                                   pad_token_id=0),
                           staging_config={"format": "prompt_completion"},
                           shards={"train": [shard("train", i) for i in range(train_shards)], "eval": []})  # fmt: skip
