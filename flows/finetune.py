"""The finetune flow: prepare model -> stage -> provision -> prefetch -> submit -> watch -> summarize.

Orchestration only; each stage is a task in ``tasks/``. The config is validated before any task runs, so a bad
config fails here without touching storage or a cluster.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_link_artifact

from ray_jobs.config import Config, ConfigError, load_config
from tasks import registry
from tasks.cancel import one_run_per_name, stop_on_cancel, stop_on_crash
from tasks.cluster import ClusterHandle, provision_cluster, stop_cluster
from tasks.jobs import JobFailed, prefetch_shards, submit_job, watch_job, write_job_spec
from tasks.model import check_model_options, prepare_base_model
from tasks.report import summarize
from tasks.stage import Staged, stage_dataset
from tasks.watchdog import failed_job_incident


def run_config(config_path: str | None, overrides: list[str] | None = None, dataset_uri: str | None = None) -> Config:
    """The config a finetune flow run trains with: the file, its overrides, and ``data.train`` from a dataset
    event's payload. Also what its run name and its cancellation hooks read (from the flow run's parameters)."""
    return load_config(config_path, [*(overrides or []), *([f"data.train={dataset_uri}"] if dataset_uri else [])])


def flow_run_name() -> str:
    """``finetune-<run name>``: the run is findable by name in the UI (the config names it)."""
    from prefect.runtime import flow_run

    try:
        cfg = run_config(**flow_run.parameters)
    except (ConfigError, OSError):
        return "finetune-invalid-config"
    return f"finetune-{cfg.name}"


@flow(
    name="finetune",
    flow_run_name=flow_run_name,
    on_cancellation=[stop_on_cancel],
    on_crashed=[stop_on_crash],
)
async def finetune(
    config_path: str | None = None, overrides: list[str] | None = None, dataset_uri: str | None = None
) -> dict[str, Any]:
    """Fine-tune a causal LM on Ray Train from a YAML config (plus ``a.b=c`` overrides, and ``dataset_uri`` as
    ``data.train`` when a dataset event started the run); returns the summary."""
    cfg = run_config(config_path, overrides, dataset_uri)
    async with one_run_per_name(cfg.name):
        return await _finetune(cfg)


async def _finetune(cfg: Config) -> dict[str, Any]:
    model_path = prepare_base_model(cfg)
    check_model_options(cfg, model_path)  # a LoRA layer the model lacks fails here, before staging or a cluster
    staged = stage_dataset(cfg, model_path)
    registry.check_compatible(cfg, staged.dataset_id)  # before any cluster work
    handle = provision_cluster(cfg)
    try:
        return await _train(cfg, handle, staged, model_path)
    finally:
        if cfg.cluster.keep_running:
            get_run_logger().info("leaving the Ray cluster running (cluster.keep_running): %s", handle.dashboard_url)
        else:
            stop_cluster(handle)


async def _train(cfg: Config, handle: ClusterHandle, staged: Staged, model_path: str) -> dict[str, Any]:
    """One attempt: preflight, submit, watch, summarize; the registry records how it ended, whatever happens.

    When the training job itself fails, this flow does not retry: it records the incident, leaves the run
    ``recovering`` and fails, so the watchdog (triggered by this failure, or on its schedule) restarts it from the
    newest valid checkpoint. Anything else (preflight finds the cluster too small, a cancel) ends the run.
    """
    extra = {"manifest_url": staged.manifest_url, "model_path": model_path}
    attempt = registry.begin_attempt(cfg, handle.to_dict(), staged.dataset_id, extra=extra)
    handed_over = False
    try:
        spec_url = write_job_spec(cfg, attempt, staged.manifest_url, model_path, resume_from=None)
        await prefetch_shards(handle, registry.submission_id(cfg.name, attempt, "preflight"), spec_url)
        submission = submit_job(handle, registry.submission_id(cfg.name, attempt), spec_url)
        await acreate_link_artifact(
            f"{handle.dashboard_url}/#/jobs/{submission}", link_text=f"Ray job {submission}",
            key=f"{cfg.name}-ray-job", description="the training job in the Ray dashboard",
        )  # fmt: skip
        try:
            await watch_job(handle, submission, cfg, attempt)
        except JobFailed as e:
            registry.hand_over(cfg, attempt, str(e), failed_job_incident(cfg, attempt, handle.address, e))
            handed_over = True
            get_run_logger().error("training job failed; the run is left to the watchdog to recover: %s", e)
            raise
        summary = summarize(cfg, staged.dataset_id, model_path)
    except BaseException as e:
        if not handed_over:
            cancelled = isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)) or "Termination" in type(e).__name__
            why = f"cancelled ({type(e).__name__})" if cancelled else f"{type(e).__name__}: {e}"
            registry.end_attempt(cfg, attempt, "STOPPED" if cancelled else "FAILED", why)
        raise
    registry.end_attempt(cfg, attempt, "SUCCEEDED", final_model=summary["final_model"])
    return summary
