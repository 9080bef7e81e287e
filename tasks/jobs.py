"""Submit the training job and watch it: the Jobs API work is control/jobs.py; here are the Prefect tasks, with the
progress artifact and the registry's ``running`` state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from prefect import task
from prefect.artifacts import acreate_progress_artifact, aupdate_progress_artifact
from prefect.cache_policies import NO_CACHE

from control import registry, series
from control.backends.base import ClusterHandle
from control.jobcode import entrypoint, user_code
from control.jobs import submit, watch
from control.logs import run_logger
from control.progress import TrainingProgress
from control.watchdog import reattach
from control.watchdog.observe import live_heartbeat
from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.contracts.trials import DONE
from ray_jobs.secrets import job_env
from ray_jobs.storage import Layout

SEARCH_POLL_S = 5.0  # how often the watch of a search reads its trials


@task(name="submit-job", cache_policy=NO_CACHE)
def submit_job(handle: ClusterHandle, submission_id: str, spec_url: str, cfg: Config) -> str:
    """Submit the run's job: the training job (``ray_jobs.job``) or a search's (``ray_jobs.search_job``). Its spec
    holds the config masked; the credentials go in the job's environment (ray_jobs/secrets.py)."""
    env = job_env(cfg.model_dump(mode="json"))
    return submit(handle, submission_id, entrypoint(cfg), spec_url, env, code=user_code(cfg))


@task(name="watch-job", cache_policy=NO_CACHE)
async def watch_job(handle: ClusterHandle, submission_id: str, cfg: Config, attempt: int, poll_s: float = 2.0) -> str:
    """Watch the training job: log tail into Prefect, its progress (a bar on a terminal, lines otherwise, restarts as
    they happen: control/progress.py) and a progress artifact (step / max_steps) while it runs, the registry's
    ``running`` state once Ray runs it."""
    shown = None if cfg.tune is not None else TrainingProgress(cfg, run_logger())
    steps = _steps_of(cfg) if shown is None else (lambda: shown.poll(_beat(cfg, attempt)))
    progress_id, marked = None, False

    async def update_progress(status: str) -> None:
        nonlocal progress_id, marked
        if status == "RUNNING" and not marked:
            marked = await asyncio.to_thread(registry.mark_running, cfg.storage, cfg.name, attempt)
        step, of = await asyncio.to_thread(steps)
        progress = min(100.0, 100.0 * step / of)
        if progress_id is None:  # created on the first poll that can: an API outage at the start is no failure
            progress_id = await acreate_progress_artifact(
                progress, key=f"{cfg.name}-progress", description=f"training steps of {cfg.name}"
            )
        else:
            await aupdate_progress_artifact(progress_id, progress=progress)

    def alive() -> str | None:  # the other channel: while the job's heartbeat is fresh, a silent API is no loss
        return live_heartbeat(cfg, attempt)

    # a hosted run's driver dead with a head restarted under GCS fault tolerance: the watch ends, a driver re-attaches
    gone = partial(reattach.driver_gone, cfg, handle) if cfg.hosted else None
    try:
        confirm_s = cfg.fault_tolerance.confirm_s
        status = await watch(handle, submission_id, poll_s, update_progress, confirm_s, alive, gone)
    except BaseException:
        if shown is not None:
            shown.close(done=False)
        raise
    if shown is not None:
        shown.close(done=status == "SUCCEEDED")
    return status


@task(name="reattach-driver", cache_policy=NO_CACHE)
def reattach_driver(cfg: Config, attempt: int, watched: str) -> str | None:
    """The watched job (``watched``) ended FAILED: when its driver died while the attempt's run host trains on
    (``fault_tolerance.run_host``), a new driver re-attaches to it (or a watchdog's did already) and its submission
    id is watched on; None when the job failed indeed (the run is handed over to the watchdog)."""
    return reattach.reattach_watched(cfg, attempt, watched)


def _beat(cfg: Config, attempt: int) -> Beat | None:
    """The attempt's heartbeat as its job last wrote it (None: none yet, or another attempt's); no age: the progress
    needs none, and an object store's clock costs a probe write."""
    try:
        beat = Beat.read(Layout(cfg.storage).heartbeat(cfg.name))
    except ValueError:  # torn, or not one this release reads (RecordError): no progress shown from it
        return None
    return beat if beat is not None and beat.attempt == attempt else None


def _steps_of(cfg: Config) -> Callable[[], tuple[int, int]]:
    """What a poll reads of a search's progress: (steps trained, steps in all), from its trials (their records
    brought up to date on the way, so ``unbroken runs`` shows each trial's state while the search runs), at most
    every few seconds."""
    assert cfg.tune is not None, "only a search's watch reads its progress from its trials"
    read_at, step = 0.0, 0
    total = cfg.train.max_steps * cfg.tune.num_trials

    def read() -> tuple[int, int]:
        nonlocal read_at, step
        if time.monotonic() - read_at >= SEARCH_POLL_S:
            found = series.sync_trials(cfg.storage, cfg.name)
            # a trial stopped early counts as done: the steps it will never train are not waited for
            read_at = time.monotonic()
            step = sum(cfg.train.max_steps if t.state in DONE else t.step for t in found.values())
        return step, total

    return read
