"""The finetune flow: prepare model -> stage (while the cluster is provisioned) -> check it fits -> submit -> watch ->
summarize.

Orchestration only; each stage is a task in ``tasks/``. The config is validated before any task runs, so a bad
config fails here without touching storage or a cluster.
"""

from __future__ import annotations

import contextlib
import time

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_link_artifact
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.states import State

from control import registry, series
from control.backends.base import StartedAhead
from control.config import Config, ConfigError, check_flow, load_config
from control.jobs import JobFailed, JobUserError
from control.records.series import SeriesRun
from control.sources import SourceRefused, rejected_event
from control.summaries import NothingNew, RunSummary, SearchSummary
from flows.cancel import one_run_per_series, stop_on_cancel, stop_on_crash
from flows.params import run_config
from flows.stage import stage_for
from ray_jobs.config.epochs import resolve_epochs
from ray_jobs.contracts.dataset import read_manifest
from ray_jobs.model.builtin import base_model_ready
from tasks.cluster import ClusterHandle, begin_cluster, check_cluster_fits, provision_cluster, stop_cluster
from tasks.jobs import reattach_driver, submit_job, watch_job
from tasks.lineage import Lineage, check_series, find_trained_run, plan_lineage
from tasks.model import check_model_options, prepare_base_model
from tasks.record import (
    check_run_compatible,
    fail_on_user_error,
    hand_over,
    record_attempt,
    record_flow_end,
    record_success,
    release_cluster,
)
from tasks.report import publish_series, summarize
from tasks.search import summarize_search
from tasks.stage import Staged, cached_dataset, stages_on_cluster


def flow_run_name() -> str:
    """``finetune-<run name>``: the run is findable by name in the UI (the config names it); ``finetune-<series>``
    when the name is a template resolved only after staging."""
    try:
        cfg = run_config(**flow_run.parameters)
    except (ConfigError, SourceRefused, OSError):
        return "finetune-invalid-config"
    return f"finetune-{cfg.series_name if cfg.is_template else cfg.name}"


def _started_at() -> float:
    """When this flow run was scheduled to start: ``{date}``/``{time}`` resolve to it, the same on a retry."""
    when = flow_run.scheduled_start_time
    return when.timestamp() if when is not None else time.time()


@flow(
    name="finetune",
    flow_run_name=flow_run_name,
    on_cancellation=[stop_on_cancel],
    on_crashed=[stop_on_crash],
)
async def finetune(
    config_path: str | None = None, overrides: list[str] | None = None, dataset_uri: str | None = None
) -> RunSummary | SearchSummary | State:
    """Fine-tune a causal LM on Ray Train from a YAML config (plus ``a.b=c`` overrides, and ``dataset_uri`` as
    ``data.train`` when a dataset event started the run); returns the summary."""
    try:
        cfg = run_config(config_path, overrides, dataset_uri)
    except SourceRefused as e:  # before anything is read from it
        rejected_event(load_config(config_path, overrides), dataset_uri, str(e))
        raise
    check_flow(cfg, search=False, source=str(config_path or "config"))
    async with one_run_per_series(cfg.series_name):
        return await finetune_body(cfg)


async def finetune_body(cfg: Config) -> RunSummary | SearchSummary | State:
    """The flow's body, the tune flow's too: a config with a ``tune`` section trains a search (one job, its trials
    runs of the series) where another trains one run."""
    search = cfg.tune is not None  # a search always searches: no "nothing new" for it
    on_cluster = stages_on_cluster(cfg)  # where staging runs, decided once for the run
    early = _provision_early(cfg, on_cluster) if not base_model_ready(cfg) else None  # a new base: nothing trained
    handle: ClusterHandle | None = None
    try:
        model_path = prepare_base_model(cfg)
        check_model_options(cfg, model_path)  # a LoRA layer the model lacks fails here, before staging or a cluster
        check_series(cfg)
        if (
            early is None and not search and (done := _trained_already(cfg, model_path, on_cluster))
        ):  # source fingerprints only, no staging
            return nothing_new(cfg, done)
        early = early or _provision_early(cfg, on_cluster)  # the cluster comes up while the data is staged
        staged, handle = stage_for(cfg, model_path, on_cluster)  # a cluster here only when staging ran on it
        if handle is None:  # staged here, or found staged already: no cluster came up with the data
            handle = early.result() if early is not None else provision_cluster(cfg)
        early = None
        staged_as = cfg.name
        cfg = resolve_epochs(cfg.resolved(staged.dataset_id, _started_at()), read_manifest(staged.manifest_url))
        if not search and (done := find_trained_run(cfg, staged.dataset_id)):
            return nothing_new(cfg, done)
        check_run_compatible(cfg, staged.dataset_id)
        lineage = plan_lineage(cfg, staged, model_path)
        if cfg.name != staged_as and handle.local:  # provisioned under the name's template: the run takes the head
            handle = provision_cluster(cfg)
            stop_cluster(cfg, handle, run=staged_as)
        summary = await _train(cfg, handle, staged, lineage)
        handle = None  # closed with the run (record_success): released unless kept
        return summary
    finally:
        if early is not None:  # the flow ended before it needed the cluster it was bringing up (if it came up)
            with contextlib.suppress(Exception):
                handle = early.result()
        if handle is not None:
            release_cluster(cfg, handle)


def start_cluster_early(cfg: Config) -> StartedAhead | None:
    """For ``unbroken run``, before the flow starts (while Prefect's temporary server boots): begin bringing up the
    cluster when the run will surely need it -- staging runs here, and no succeeded run of this series trained this
    recipe (so the run cannot have nothing new to train). Returns what to ``release()`` after the flow, or None."""
    if stages_on_cluster(cfg) or (cfg.tune is None and series.trained_this_recipe(cfg)):
        return None
    return begin_cluster(cfg)


def _provision_early(cfg: Config, on_cluster: bool) -> PrefectFuture | None:
    """Start provisioning the cluster now, in the background (Prefect's task runner), when staging runs here: a head
    takes seconds to come up, and the base model and the data are prepared meanwhile. None when staging runs on the
    cluster (``stage_for`` provisions it first)."""
    return None if on_cluster else provision_cluster.submit(cfg)


def _trained_already(cfg: Config, model_path: str, on_cluster: bool) -> SeriesRun | None:
    """The run of this series that already trained this data with this recipe, when source fingerprints alone show
    the dataset staged (no staging, no cluster: a cron tick on unchanged data ends here)."""
    if on_cluster:
        return None
    found = cached_dataset(cfg, model_path)
    return find_trained_run(cfg, found.dataset_id) if found is not None else None


def nothing_new(cfg: Config, done: SeriesRun) -> State:
    """The series already trained this dataset with this recipe: no cluster, no training, a Completed flow run that
    says so (a cron tick with unchanged data, or the same dataset event twice)."""
    from prefect.states import Completed

    rec = registry.load(cfg.storage, done.run)
    assert rec is not None, "find_trained_run returns only a run whose record says it succeeded"
    final = rec.final_model
    message = f"nothing new to train: run {done.run} already trained on dataset {done.dataset_id}"
    get_run_logger().info(message)
    summary: NothingNew = {
        "run": done.run,
        "dataset_id": done.dataset_id,
        "nothing_new": True,
        "message": message,
        "final_model": final,
    }
    return Completed(message=message, data=summary)


async def _train(cfg: Config, handle: ClusterHandle, staged: Staged, lineage: Lineage) -> RunSummary | SearchSummary:
    """One attempt: check the run fits its cluster, then record the attempt and submit, watch, summarize, close.

    The attempt is recorded only once the run is known to fit (a watchdog pass meanwhile sees nothing to do),
    under the run's lease, and refused while another attempt of the run is in flight. When the training job fails,
    this flow does not retry: it records the incident, leaves the run ``recovering`` and fails, so the watchdog
    restarts it from the newest valid checkpoint. If this flow dies, the job trains on and the watchdog adopts it.
    """
    check_cluster_fits(cfg, handle, read_manifest(staged.manifest_url))
    attempt, spec_url = record_attempt(
        cfg, handle, staged.dataset_id, staged.manifest_url, lineage.start, lineage.pin, lineage.parent_run
    )
    try:
        summary = await _run_job(cfg, handle, staged, attempt, spec_url)
    except JobFailed:
        raise
    except BaseException as e:
        record_flow_end.fn(cfg, attempt, e)  # not a task run: a cancelled flow run still records its end
        raise
    summary["verdict"] = record_success(cfg, attempt, summary["final_model"], handle)
    await publish_series(cfg)
    return summary


async def _run_job(
    cfg: Config, handle: ClusterHandle, staged: Staged, attempt: int, spec_url: str
) -> RunSummary | SearchSummary:
    """Submit the attempt's job, watch it to its end, summarize; a failed job is handed over to the watchdog."""
    submission = submit_job(handle, registry.submission_id(cfg.storage, cfg.name, attempt), spec_url, cfg)
    await acreate_link_artifact(
        f"{handle.dashboard_url}/#/jobs/{submission}",
        link_text=f"Ray job {submission}",
        key=f"{cfg.name}-ray-job",
        description="the training job in the Ray dashboard",
    )
    while True:
        try:
            await watch_job(handle, submission, cfg, attempt)
            break
        except JobUserError as e:
            fail_on_user_error(cfg, attempt, e)
            raise
        except JobFailed as e:  # its driver lost while its run host trains on: watched on under a new driver
            if (submission := reattach_driver(cfg, attempt, submission)) is None:
                hand_over(cfg, attempt, handle.address, e)
                raise
    if cfg.tune is not None:
        return summarize_search(cfg, staged.dataset_id)
    return summarize(cfg, staged.dataset_id)
