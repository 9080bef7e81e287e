"""Stage the dataset onto shared storage (a content-addressed cache hit when nothing changed), here or on the cluster."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, cast

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from control.backends.base import ClusterHandle
from control.jobs import JobFailed, run_to_end, submit
from control.logs import run_logger
from ray_jobs.config import Config
from ray_jobs.contracts.dataset import read_manifest
from ray_jobs.contracts.job_spec import StageSpec
from ray_jobs.data.fingerprint import describe
from ray_jobs.data.mixture import train_sources
from ray_jobs.data.staging import StageResult, StagingError, cached, stage, summary
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.progress import Reporter, Snapshot, SnapshotJson, every_s, then
from ray_jobs.secrets import job_env
from ray_jobs.storage import Layout, exists, is_local, read_json, write_json_atomic

if TYPE_CHECKING:  # transformers is imported when a tokenizer is loaded, not with the flow
    from transformers import PreTrainedTokenizerBase

PROGRESS_POLL_S = 2.0  # how often the flow reads the progress a staging job on the cluster writes (every 5 s)


@dataclass
class Staged:
    dataset_id: str
    manifest_url: str
    cache_hit: bool
    counts: dict[str, int]  # the manifest's (ray_jobs/contracts/dataset.Counts), as the flow's result keeps them
    summary: str = ""  # what staging made of the records (staging.summary), for people

    def to_dict(self) -> StagedDict:
        return {
            "dataset_id": self.dataset_id,
            "manifest_url": self.manifest_url,
            "cache_hit": self.cache_hit,
            "counts": self.counts,
            "summary": self.summary,
        }


class StagedDict(TypedDict):
    """A Staged as the stage flow returns it (and ``unbroken stage`` prints it)."""

    dataset_id: str
    manifest_url: str
    cache_hit: bool
    counts: dict[str, int]
    summary: str


def stages_on_cluster(cfg: Config) -> bool:
    """Whether this config's staging runs on the cluster (``data.stage_on``; ``auto``: sources of at least
    ``data.cluster_stage_mb`` the cluster can read, on an object store or with a local head)."""
    if cfg.data.stage_on != "auto":
        return cfg.data.stage_on == "cluster"
    named = [(s.url, s.field) for s in train_sources(cfg.data)]  # a hub dataset: its split's file here
    named += [(cfg.data.eval, "data.eval")] if cfg.data.eval else []
    readable = not cfg.cluster.address or not any(is_local(u) for u, _ in named)
    if not readable:
        return False
    size = sum(f.size for u, field in named for f in describe(u, field))
    return size >= cfg.data.cluster_stage_mb * 1e6


def _tokenizer(cfg: Config, model_path: str) -> PreTrainedTokenizerBase:
    try:
        return load_tokenizer(model_path, cfg.data.cache_dir)
    except (OSError, ValueError) as e:
        raise StagingError(f"model.name_or_path: cannot load a tokenizer from {model_path}: {e}") from e


@task(name="find-staged-dataset", cache_policy=NO_CACHE)
def cached_dataset(cfg: Config, model_path: str) -> Staged | None:
    """The dataset, when source fingerprints alone show it is staged already (no cluster needed to find out)."""
    result = cached(cfg.data, _tokenizer(cfg, model_path), cfg.storage)
    return None if result is None else _report(result)


@task(name="stage-dataset", cache_policy=NO_CACHE)
def stage_dataset(cfg: Config, model_path: str, handle: ClusterHandle | None = None) -> Staged:
    """Validate, tokenize and pack ``data.train`` into Parquet shards + manifest under ``<storage>/datasets``: here,
    or as a Ray job on ``handle``'s cluster (the same shards and manifest either way)."""
    if handle is not None:
        return _report(_stage_on_cluster(cfg, model_path, handle))
    return _report(_stage_here(cfg, model_path))


def _stage_here(cfg: Config, model_path: str) -> StageResult:
    """Staging in this process: a progress line in the run's log every few seconds (a bar on a terminal) and the
    progress artifact, as source bytes are read."""
    artifact = ProgressArtifact(cfg)
    reporter = Reporter("staging", log=run_logger(), rates=("tokens",), on_update=artifact.show, quiet_s=every_s())
    writing = Reporter("writing shards", unit="rows", log=run_logger(), quiet_s=5.0)
    tokenizer = _tokenizer(cfg, model_path)
    result = stage(
        cfg.data, tokenizer, model_path, cfg.storage, progress=reporter.update, writing=then(reporter, writing)
    )
    reporter.finish()
    writing.finish()
    return result


class ProgressArtifact:
    """Staging's progress as one Prefect progress artifact (key ``<series>-staging``), created on the first update
    and updated in place, its description the progress line. Never fails the staging."""

    def __init__(self, cfg: Config) -> None:
        self.key = re.sub(r"[^a-z0-9-]+", "-", f"{cfg.series_name}-staging".lower()).strip("-")
        self.id: uuid.UUID | None = None

    def show(self, snap: Snapshot | SnapshotJson) -> None:
        """``snap``: a Reporter's snapshot, or its JSON (what a staging job writes)."""
        pct, line = (snap.percent, snap.line()) if isinstance(snap, Snapshot) else (snap["percent"], snap["line"])
        # _sync=True: the sync function, even on an async flow's thread. Prefect's async_dispatch takes it at run
        # time, but its type declares neither the argument nor that the result is then the sync function's (a UUID)
        if self.id is None:
            created = create_progress_artifact(pct or 0.0, key=self.key, description=line, _sync=True)  # ty: ignore[unknown-argument]
            self.id = cast(uuid.UUID, created)
        else:
            update_progress_artifact(self.id, pct or 0.0, description=line, _sync=True)  # ty: ignore[unknown-argument]


class _JobProgress:
    """What a staging job on the cluster writes of its progress (``<submission>.progress.json``, every few
    seconds), read while the flow waits for the job, into the progress artifact. Its lines reach the run's log with
    the job's own (the forwarded job log)."""

    def __init__(self, url: str, artifact: ProgressArtifact) -> None:
        self.url, self.artifact, self.seen = url, artifact, None

    async def poll(self, status: str) -> None:
        await asyncio.to_thread(self.show)

    def show(self) -> None:
        snap = read_json(self.url) if exists(self.url) else None
        if snap is not None and snap != self.seen:
            self.seen = snap
            self.artifact.show(snap)


def _stage_on_cluster(cfg: Config, model_path: str, handle: ClusterHandle) -> StageResult:
    sid = f"unbroken-stage-{uuid.uuid4().hex[:12]}"
    layout = Layout(cfg.storage)
    spec_url, outcome_url = layout.staging_job(sid), layout.staging_job(sid, outcome=True)
    progress = _JobProgress(spec_url.removesuffix(".json") + ".progress.json", ProgressArtifact(cfg))
    spec = StageSpec(
        config=cfg.model_dump(mode="json"), model_path=model_path, outcome_url=outcome_url, progress_url=progress.url
    )
    write_json_atomic(spec_url, spec.model_dump(mode="json"))
    run_logger().info("staging on the cluster at %s (Ray job %s)", handle.address, sid)
    submit(handle, sid, "ray_jobs.stage_job", spec_url, job_env(cfg.model_dump(mode="json")))  # a source's credentials
    try:
        run_to_end(handle, sid, PROGRESS_POLL_S, cfg.fault_tolerance.confirm_s, on_poll=progress.poll)
    except JobFailed as e:
        if exists(outcome_url) and (error := read_json(outcome_url).get("error")):
            raise StagingError(error) from None
        raise JobFailed(f"staging on the cluster failed: {e}") from e
    out = read_json(outcome_url)
    return StageResult(
        out["dataset_id"],
        out["manifest_url"],
        out["cache_hit"],
        read_manifest(out["manifest_url"]),
        out["sources_read"],
    )


def _report(result: StageResult) -> Staged:
    counts = result.manifest.counts
    verb = "cache hit" if result.cache_hit else "staged"
    run_logger().info(
        "%s dataset %s: %s -> %d train / %d eval rows; manifest %s",
        verb,
        result.dataset_id,
        summary(result.manifest),
        counts.train_rows,
        counts.eval_rows,
        result.manifest_url,
    )
    return Staged(
        result.dataset_id, result.manifest_url, result.cache_hit, counts.model_dump(), summary(result.manifest)
    )
