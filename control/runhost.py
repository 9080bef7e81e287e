"""The control plane's hold on a run host (``fault_tolerance.run_host``, ray_jobs/host.py): stopping an attempt's
host where its driver cannot -- the driver died (kill -9, a lost head) and then the run is cancelled, given up on,
restarted, or superseded. A host outlives its driver by design; a run that is stopped must not leave one training
unwatched, and a restart must never leave two attempts training into the same checkpoints.

The host is reached as everything on the cluster is, through the Jobs API: a short job,
``python -m ray_jobs.job --spec <url> --stop-host``, finds it by its name, kills it (its controller and workers are
its own and go with it) and waits until it is gone. Written by hand: Ray has no API to kill a named actor from outside
the cluster but a client connection, which the control plane does not hold."""

from __future__ import annotations

import uuid
from dataclasses import replace

from control import jobsapi, registry
from control.backends.base import ClusterError, ClusterHandle
from control.jobcode import entrypoint
from control.jobs import submit
from ray_jobs.config import Config
from ray_jobs.host import STOP_LINE
from ray_jobs.poll import poll_until
from ray_jobs.storage import Layout

STOP_WAIT_S = 60.0  # the stop job's start (a driver process, ray.init) and the host's end


def stop_run_host(cfg: Config, handle: ClusterHandle, attempt: int, wait_s: float = STOP_WAIT_S) -> bool:
    """Stop attempt ``attempt``'s run host if it still lives; True when one was stopped, False when there was none
    (or the run has no run host). ClusterError when the stop job failed or outlived ``wait_s``; the submission's own
    errors (StopUnverified, ClusterError) when the cluster does not take it."""
    if not cfg.hosted:
        return False
    spec = Layout(cfg.storage).job_spec(cfg.name, attempt)
    sid = f"{registry.submission_id(cfg.storage, cfg.name, attempt, kind='hoststop')}-{uuid.uuid4().hex[:6]}"
    submit(replace(handle, python=cfg.cluster.python), sid, entrypoint(cfg), spec, flags=("--stop-host",))
    last = [jobsapi.JobView("unknown")]

    def ended() -> bool:
        last[0] = jobsapi.read_job(handle.address, sid)
        return last[0].terminal

    if not poll_until(ended, wait_s, every_s=0.5):
        raise ClusterError(f"stopping the run host of attempt {attempt}: job {sid} did not end within {wait_s:.0f}s")
    said = [line for line in (jobsapi.job_logs(handle.address, sid) or "").splitlines() if line.startswith(STOP_LINE)]
    if last[0].status != "SUCCEEDED" or not said:
        why = f"{last[0].status} {last[0].message}".strip()
        raise ClusterError(f"stopping the run host of attempt {attempt}: job {sid} ended {why}")
    return said[-1].split()[-1] == "stopped"
