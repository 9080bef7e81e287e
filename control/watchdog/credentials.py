"""Where a restarted job's credentials come from. The watchdog restarts a run from its record alone, and the record,
like everything on storage, holds its URIs masked (ray_jobs/secrets.py); the job reveals them from the
``UNBROKEN_CREDENTIALS`` it is submitted with. The watchdog's own environment comes first (a watchdog on another
machine than the flow's needs it exported); else the previous attempt's job, whose runtime_env the Jobs API still
reports while the cluster answers; else the job runs with its URIs masked, and says so in its log (a tracker then
runs without its server: training goes on)."""

from __future__ import annotations

from control import jobsapi
from control.logs import run_logger
from control.records.run import RunRecord
from ray_jobs.secrets import CREDENTIALS_ENV, credentials_in, job_env, still_masked


def for_resubmission(reg: RunRecord) -> dict[str, str]:
    """The environment that carries run ``reg``'s credentials to the job about to replace its current attempt's
    (read before that attempt is superseded): ``{UNBROKEN_CREDENTIALS: ...}``, or {} when none can be had."""
    if own := job_env():
        return own
    previous = _previous_job(reg)
    if previous:
        return {CREDENTIALS_ENV: previous}
    if missing := still_masked(reg.config):
        run_logger().warning(
            "run %s: the credentials of %s are not available here (%s is not set, and the previous "
            "job's cannot be read): the restarted job runs without them",
            reg.name,
            ", ".join(missing),
            CREDENTIALS_ENV,
        )
    return {}


def _previous_job(reg: RunRecord) -> str:
    """The credentials the current attempt's job was submitted with, as the Jobs API reports them ("" if it cannot)."""
    if reg.cluster is None or not reg.attempts:
        return ""
    env = jobsapi.job_env(reg.cluster.url(), reg.current.submission_id) or {}
    # the URIs alone: a value the dashboard redacted ("<redacted>", what it shows a browser) is no credential
    return " ".join(credentials_in(env.get(CREDENTIALS_ENV, "")))
