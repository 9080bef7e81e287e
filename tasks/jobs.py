"""Submit the training job and watch it: the Jobs API work is control/jobs.py; here are the Prefect tasks, with the
progress artifact and the registry's ``running`` state."""

from __future__ import annotations

import asyncio

from prefect import task
from prefect.artifacts import acreate_progress_artifact, aupdate_progress_artifact
from prefect.cache_policies import NO_CACHE

from control import registry
from control.backends.base import ClusterHandle
from control.jobs import submit, watch
from ray_jobs.config import Config
from ray_jobs.storage import Layout
from ray_jobs.train.metrics import MetricsTail


@task(name="submit-job", cache_policy=NO_CACHE)
def submit_job(handle: ClusterHandle, submission_id: str, spec_url: str) -> str:
    """Submit the training job (``ray_jobs.job``)."""
    return submit(handle, submission_id, "ray_jobs.job", spec_url)


@task(name="watch-job", cache_policy=NO_CACHE)
async def watch_job(handle: ClusterHandle, submission_id: str, cfg: Config, attempt: int, poll_s: float = 2.0) -> str:
    """Watch the training job: log tail into Prefect, a progress artifact (step / max_steps) while it runs, the
    registry's ``running`` state once Ray runs it."""
    metrics = MetricsTail(Layout(cfg.storage).metrics(cfg.name))  # each poll reads only what is new
    progress_id, marked = None, False

    async def update_progress(status: str) -> None:
        nonlocal progress_id, marked
        if status == "RUNNING" and not marked:
            marked = await asyncio.to_thread(registry.mark_running, cfg.storage, cfg.name, attempt)
        step = await asyncio.to_thread(metrics.last_step)
        progress = min(100.0, 100.0 * step / cfg.train.max_steps)
        if progress_id is None:  # created on the first poll that can: an API outage at the start is no failure
            progress_id = await acreate_progress_artifact(
                progress, key=f"{cfg.name}-progress", description=f"training steps of {cfg.name}"
            )
        else:
            await aupdate_progress_artifact(progress_id, progress=progress)

    return await watch(handle, submission_id, poll_s, on_poll=update_progress, confirm_s=cfg.fault_tolerance.confirm_s)
