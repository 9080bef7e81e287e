"""The finetune flow: prepare model -> stage (while the cluster is provisioned) -> check it fits -> submit -> watch ->
summarize.

Orchestration only; each stage is a task in ``tasks/``. The config is validated before any task runs, so a bad
config fails here without touching storage or a cluster.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_link_artifact
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.states import State

from control import registry, series
from control.config import Config, ConfigError, load_config
from control.jobs import JobFailed, cancelled, stop_and_wait, write_job_spec
from control.records.series import EvalPin, SeriesRun
from control.sources import SourceRefused, rejected_event
from control.watchdog import failed_job_incident
from flows.cancel import one_run_per_series, stop_on_cancel, stop_on_crash
from flows.params import run_config
from flows.stage import stage_for
from ray_jobs.model.builtin import base_model_ready
from ray_jobs.storage import read_json
from tasks.cluster import ClusterHandle, begin_cluster, check_cluster_fits, provision_cluster, stop_cluster
from tasks.jobs import submit_job, watch_job
from tasks.model import check_model_options, prepare_base_model
from tasks.report import publish_series, summarize
from tasks.stage import Staged, cached_dataset, stage_dataset, stages_on_cluster


@dataclass
class Lineage:
    base: str  # model.name_or_path's folder: tokenization follows it
    start: str  # the weights the run starts from: the base, or a warm start's final folder
    parent: series.WarmStart | None  # the run warm-started from (series.warm_start)
    pin: EvalPin  # the series' fixed eval set

    @property
    def score_manifest_url(self) -> str:
        return self.pin.manifest_url


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
) -> dict[str, Any]:
    """Fine-tune a causal LM on Ray Train from a YAML config (plus ``a.b=c`` overrides, and ``dataset_uri`` as
    ``data.train`` when a dataset event started the run); returns the summary."""
    try:
        cfg = run_config(config_path, overrides, dataset_uri)
    except SourceRefused as e:  # before anything is read from it
        rejected_event(load_config(config_path, overrides), dataset_uri, str(e))
        raise
    async with one_run_per_series(cfg.series_name):
        return await _finetune(cfg)


async def _finetune(cfg: Config) -> dict[str, Any] | State:
    early = _provision_early(cfg) if not base_model_ready(cfg) else None  # a new base: nothing trained on it yet
    handle: ClusterHandle | None = None
    try:
        model_path = prepare_base_model(cfg)
        check_model_options(cfg, model_path)  # a LoRA layer the model lacks fails here, before staging or a cluster
        series.check_eval_source(cfg)
        if early is None and (done := _trained_already(cfg, model_path)):  # source fingerprints only, no staging
            return nothing_new(cfg, done)
        early = early or _provision_early(cfg)  # the cluster comes up while the data is staged
        staged, handle = stage_for(cfg, model_path)  # a cluster here only when staging ran on it
        handle = handle or early.result()
        early = None
        staged_as = cfg.name
        cfg = cfg.resolved(staged.dataset_id, _started_at())
        if done := series.already_trained(cfg, staged.dataset_id):
            return nothing_new(cfg, done)
        registry.check_compatible(cfg, staged.dataset_id)
        lineage = _lineage(cfg, staged, model_path)
        if cfg.name != staged_as and handle.local:  # provisioned under the name's template: the run takes the head
            handle = provision_cluster(cfg)
            stop_cluster(cfg, handle, run=staged_as)
        return await _train(cfg, handle, staged, lineage)
    finally:
        if early is not None:  # the flow ended before it needed the cluster it was bringing up (if it came up)
            with contextlib.suppress(Exception):
                handle = early.result()
        if handle is not None:
            _release_cluster(cfg, handle)


def start_cluster_early(cfg: Config):
    """For ``unbroken run``, before the flow starts (while Prefect's temporary server boots): begin bringing up the
    cluster when the run will surely need it -- staging runs here, and no succeeded run of this series trained this
    recipe (so the run cannot have nothing new to train). Returns what to ``release()`` after the flow, or None."""
    if stages_on_cluster(cfg) or series.trained_this_recipe(cfg):
        return None
    return begin_cluster(cfg)


def _provision_early(cfg: Config) -> PrefectFuture | None:
    """Start provisioning the cluster now, in the background (Prefect's task runner), when staging runs here: a head
    takes seconds to come up, and the base model and the data are prepared meanwhile. None when staging runs on the
    cluster (``stage_for`` provisions it first)."""
    return None if stages_on_cluster(cfg) else provision_cluster.submit(cfg)


def _trained_already(cfg: Config, model_path: str) -> SeriesRun | None:
    """The run of this series that already trained this data with this recipe, when source fingerprints alone show
    the dataset staged (no staging, no cluster: a cron tick on unchanged data ends here)."""
    if stages_on_cluster(cfg):
        return None
    found = cached_dataset(cfg, model_path)
    return series.already_trained(cfg, found.dataset_id) if found is not None else None


def nothing_new(cfg: Config, done: SeriesRun) -> State:
    """The series already trained this dataset with this recipe: no cluster, no training, a Completed flow run that
    says so (a cron tick with unchanged data, or the same dataset event twice)."""
    from prefect.states import Completed

    final = registry.load(cfg.storage, done.run).get("final_model")
    message = f"nothing new to train: run {done.run} already trained on dataset {done.dataset_id}"
    get_run_logger().info(message)
    summary = {"run": done.run, "dataset_id": done.dataset_id, "nothing_new": True, "message": message,
               "final_model": final}  # fmt: skip
    return Completed(message=message, data=summary)


def _lineage(cfg: Config, staged: Staged, base_model: str) -> Lineage:
    """Where this run starts from (the base model, or a warm start from the series) and the series' pinned eval set
    it is scored on (pinned, with the run's place in the series, once its attempt is recorded)."""
    log = get_run_logger()
    parent = series.warm_start(cfg)
    if cfg.model.init_from != "base" and parent is None:
        log.warning("model.init_from=%s: series %s has no such run yet; starting from the base model %s",
                    cfg.model.init_from, cfg.series_name, cfg.model.name_or_path)  # fmt: skip
    pin = series.pinned_eval(cfg) or _eval_pin(cfg, staged, base_model)
    start = parent.final_model if parent else base_model
    if parent:
        log.info("warm start from run %s (%s): %s", parent.run, cfg.model.init_from, start)
    return Lineage(base_model, start, parent, pin)


def _eval_pin(cfg: Config, staged: Staged, base_model: str) -> EvalPin:
    """The series' fixed eval set for its first run: ``series.eval`` staged on its own, or this run's eval split."""
    if cfg.series.eval:
        ev = cfg.model_copy(deep=True)
        ev.data.train = ev.data.eval = cfg.series.eval
        staged, source = stage_dataset(ev, base_model), cfg.series.eval
    else:
        source = f"the eval split of run {cfg.name}"
    if not staged.counts.get("eval_rows"):
        raise ConfigError([f"series.eval: {source} has no eval rows to score the series' runs on; name an eval set"])
    return EvalPin(dataset_id=staged.dataset_id, manifest_url=staged.manifest_url, source=source)


def _release_cluster(cfg: Config, handle: ClusterHandle) -> None:
    """Stop the local head this run used, unless kept, or unless the run still needs it: a job the watchdog now
    looks after (a failed job it will restart, an adopted one) -- it stops the head when it closes the run."""
    log = get_run_logger()
    reg = registry.load(cfg.storage, cfg.name)
    if cfg.cluster.keep_running:
        log.info("leaving the Ray cluster running (cluster.keep_running): %s", handle.dashboard_url)
    elif reg is not None and reg.get("state") in registry.ACTIVE:
        log.info("leaving the Ray cluster running for the watchdog (run %s is %s)", cfg.name, reg["state"])
    else:
        stop_cluster(cfg, handle, run=cfg.name)


async def _train(cfg: Config, handle: ClusterHandle, staged: Staged, lineage: Lineage) -> dict[str, Any]:
    """One attempt: check the run fits its cluster, then record the attempt and submit, watch, summarize.

    The attempt is recorded only once the run is known to fit (a watchdog pass meanwhile sees nothing to do),
    under the run's lease, and refused while another attempt of the run is in flight. When the training job fails,
    this flow does not retry: it records the incident, leaves the run ``recovering`` and fails, so the watchdog
    restarts it from the newest valid checkpoint. If this flow dies, the job trains on and the watchdog adopts it.
    """
    check_cluster_fits(cfg, handle, read_json(staged.manifest_url))
    attempt = registry.next_attempt(cfg)
    spec_url = write_job_spec(cfg, attempt, staged.manifest_url, lineage.start, None, lineage.score_manifest_url)
    stop_superseded_job(cfg)
    parent = lineage.parent.run if lineage.parent else None
    extra = {"manifest_url": staged.manifest_url, "model_path": lineage.start, "parent": parent,
             "score_manifest_url": lineage.score_manifest_url}  # fmt: skip
    registry.begin_attempt(cfg, handle.to_dict(), staged.dataset_id, extra=extra, expect=attempt)
    series.begin_run(cfg, staged.dataset_id, lineage.pin, parent, flow_run.id)
    handed_over = False
    try:
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
        summary = summarize(cfg, staged.dataset_id, lineage.start)
    except BaseException as e:
        if not handed_over:
            _end_unless_training(cfg, attempt, e)
        raise
    registry.end_attempt(cfg, attempt, "SUCCEEDED", final_model=summary["final_model"])
    verdict = series.finish_run(cfg.storage, cfg.name)
    summary["verdict"] = verdict.dump() if verdict else None  # the summary stays plain JSON (the flow's result)
    await publish_series(cfg)
    return summary


def _end_unless_training(cfg: Config, attempt: int, e: BaseException) -> None:
    """A cancel ends the run (its job was stopped); an error of this flow's own (not of the job) leaves the
    attempt to the watchdog, whose job may be training fine."""
    if cancelled(e):
        registry.end_attempt(cfg, attempt, "STOPPED", f"cancelled ({type(e).__name__})")
    else:
        registry.adopt(cfg, attempt, f"the finetune flow failed: {type(e).__name__}: {e}")


def stop_superseded_job(cfg: Config) -> None:
    """Before a new attempt of a run that was recovering: make sure its last job no longer runs (a stall or a
    lost cluster is recorded without the job being known to have ended). StopUnverified stops this flow."""
    reg = registry.load(cfg.storage, cfg.name)
    if reg and reg.get("attempts") and reg.get("state") == "recovering":
        last = registry.current_attempt(reg)
        if stop_and_wait(reg["cluster"]["address"], last["submission_id"]):
            get_run_logger().warning("stopped Ray job %s of the recovering attempt", last["submission_id"])
