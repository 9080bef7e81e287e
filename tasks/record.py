"""The run record's changes a finetune flow makes, as tasks the Prefect UI shows: record an attempt (once the run
fits its cluster), hand a failed job over to the watchdog, record how the attempt ended, close a succeeded run (the
watchdog's closing too: control/attempt.close_run), release the cluster of a run that ends otherwise. The record and
its rules are control/registry.py; the watchdog makes its own changes there under the run's lease."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from control import registry, series
from control.attempt import close_run, release_unless_kept, start_attempt
from control.backends import handle_from_record
from control.backends.base import ClusterHandle
from control.jobs import cancelled, stop_and_wait
from control.logs import run_logger
from control.records.series import EvalPin
from control.runhost import stop_run_host
from control.summaries import VerdictSummary, verdict_summary
from control.tracking import end_tracker_runs
from control.watchdog import failed_job_incident
from ray_jobs.config import Config
from ray_jobs.contracts.job_spec import AttemptInputs


@task(name="check-run-compatible", cache_policy=NO_CACHE)
def check_run_compatible(cfg: Config, dataset_id: str) -> None:
    """RunConflict when the run's name exists with another dataset or a setting its checkpoints cannot take."""
    registry.check_compatible(cfg, dataset_id)


@task(name="record-attempt", cache_policy=NO_CACHE)
def record_attempt(
    cfg: Config, handle: ClusterHandle, dataset_id: str, manifest_url: str, start: str, pin: EvalPin, parent: str | None
) -> tuple[int, str]:
    """Make sure a recovering attempt's job no longer runs, then record the attempt (refused while another is in
    flight) with its job spec -- written under the run's lease once the attempt is known to be this flow's, so a
    flow that is refused never overwrites the winner's -- and the run's place in its series (a search's trials too:
    each a run). Returns (attempt, job spec URL)."""
    _stop_superseded_job(cfg)
    # the summarize task publishes the sample generations the job writes
    inputs = AttemptInputs(
        manifest_url=manifest_url, model_path=start, score_manifest_url=pin.manifest_url, parent=parent, samples=True
    )
    trials = None
    if cfg.tune is not None:  # a search: its trials are runs of their own, recorded before it starts
        trials = [t.name for t in series.record_trials(cfg, dataset_id, inputs)]
    run_id = str(flow_run.id) if flow_run.id else None
    attempt, spec_url = start_attempt(cfg, handle.to_dict(), dataset_id, inputs, flow_run_id=run_id, trials=trials)
    series.begin_run(cfg, dataset_id, pin, parent, flow_run.id)
    return attempt, spec_url


def _stop_superseded_job(cfg: Config) -> None:
    """Before a new attempt of a run that was recovering: make sure its last job no longer runs (a stall or a
    lost cluster is recorded without the job being known to have ended). StopUnverified stops this flow."""
    reg = registry.load(cfg.storage, cfg.name)
    if reg and reg.attempts and reg.state == "recovering":
        last = reg.current
        assert reg.cluster is not None, "every attempt is recorded with its cluster (registry.begin_attempt)"
        if stop_and_wait(reg.cluster.url(), last.submission_id):
            run_logger().warning("stopped Ray job %s of the recovering attempt", last.submission_id)
        if stop_run_host(cfg, handle_from_record(reg.recorded_cluster), last.attempt):
            run_logger().warning("stopped the run host of the recovering attempt %d", last.attempt)


@task(name="hand-over-to-watchdog", cache_policy=NO_CACHE)
def hand_over(cfg: Config, attempt: int, address: str, failure: Exception) -> None:
    """The training job failed: record the incident the watchdog would have, and leave the run ``recovering``."""
    registry.hand_over(cfg, attempt, str(failure), failed_job_incident(cfg, attempt, address, failure))
    run_logger().error("training job failed; the run is left to the watchdog to recover: %s", failure)


def fail_on_user_error(cfg: Config, attempt: int, failure: Exception) -> None:
    """The training job failed on the user's mistake (a reward function that raised, a record a worker could not
    read): every restart would fail the same way, so the run ends ``failed`` with it as the reason -- its
    checkpoints kept, its trackers' runs ended, its cluster released -- and no watchdog is left anything to do."""
    if registry.end_attempt(cfg, attempt, "FAILED", str(failure)) is not None:
        end_tracker_runs(cfg, "FAILED", f"it failed on the input: {failure}")
    run_logger().error("training job failed on the run's input; not restarted: %s", failure)


@task(name="record-success", cache_policy=NO_CACHE)
def record_success(cfg: Config, attempt: int, final_model: str | None, handle: ClusterHandle) -> VerdictSummary | None:
    """The attempt succeeded: record it, close the run -- scored against its series' champion, its cluster released
    unless kept -- and mark it closed (nothing is left for the watchdog to close). The verdict, or None; None too
    when the watchdog had already dealt with the attempt (recorded it failed, restarted the run): the run, and the
    cluster its new attempt may run on, are the watchdog's to close."""
    if registry.end_attempt(cfg, attempt, "SUCCEEDED", final_model=final_model) is None:
        run_logger().warning("run %s: the watchdog already dealt with attempt %d; it closes the run", cfg.name, attempt)
        return None
    verdict = close_run(cfg, handle)
    registry.closed(cfg.storage, cfg.name)
    return verdict_summary(verdict) if verdict else None  # plain JSON: it goes into the flow's result


@task(name="record-flow-end", cache_policy=NO_CACHE)
def record_flow_end(cfg: Config, attempt: int, e: BaseException) -> None:
    """This flow ends before its job did: a cancel ends the run (its job was stopped); an error of the flow's own
    (not of the job) leaves the attempt to the watchdog, whose job may be training fine."""
    if cancelled(e):
        registry.end_attempt(cfg, attempt, "STOPPED", f"cancelled ({type(e).__name__})")
        end_tracker_runs(cfg, "KILLED", "its flow run was cancelled")
        if cfg.tune is not None:  # the search's job was stopped, and every trial with its driver
            series.end_unfinished(cfg.storage, cfg.name, "its search was cancelled")
    else:
        registry.adopt(cfg, attempt, f"the finetune flow failed: {type(e).__name__}: {e}")


@task(name="release-cluster", cache_policy=NO_CACHE)
def release_cluster(cfg: Config, handle: ClusterHandle) -> None:
    """The flow ends without having closed its run (it failed, was cancelled, found nothing new, or its closing
    raised): release the run's cluster unless kept, or unless the run still needs it -- a job the watchdog now looks
    after (a failed job it will restart, an adopted one): the watchdog releases it when it closes the run."""
    reg = registry.load(cfg.storage, cfg.name)
    if reg is not None and reg.active and not cfg.cluster.keep_running:
        run_logger().info("leaving the Ray cluster running for the watchdog (run %s is %s)", cfg.name, reg.state)
    else:
        release_unless_kept(cfg, handle)
    if reg is not None and reg.closing_since is not None and series.scored(cfg.storage, cfg.name):
        registry.closed(cfg.storage, cfg.name)  # scored and released: nothing is left for the watchdog to close
