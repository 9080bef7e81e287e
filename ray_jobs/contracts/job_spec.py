"""What the control plane gives a job on the cluster, on shared storage (the job's only argument is its URL):
written by ``control/jobs.py`` (training, search) and ``tasks/stage.py`` (staging), read by the job's entrypoint
through ``ray_jobs.config.loading.job_spec``. The config travels whole, as its JSON tree, and is validated again
where it is read (``ray_jobs.config.from_json``): a job never trusts a file for its types."""

from __future__ import annotations

from typing import ClassVar

from pydantic import JsonValue

from ray_jobs.contracts.base import Part, Record
from ray_jobs.contracts.dataset import DatasetManifest


class Spec(Record):
    """What every job's spec holds: the run's config."""

    config: dict[str, JsonValue]  # the run's Config as JSON (credentials masked; revealed where the job reads it)


class JobSpec(Spec):
    """A training job's or a search's: the staged data, the weights to start from, the checkpoint to resume (None:
    the newest valid one, or a fresh start), the attempt it is, the series' pinned eval set the final model is
    scored on, and the series run it warm-starts from (its trackers tag the run with it)."""

    SCHEMA: ClassVar[int] = 1
    manifest_url: str
    model_path: str
    resume_from: str | None = None
    attempt: int = 0
    score_manifest_url: str | None = None
    parent: str | None = None
    samples: bool = False  # write runs/<run>/samples.json after the export (the finetune flow's attempts publish it)


class StageSpec(Spec):
    """A staging job's: the config, the tokenizer's model, and where the job writes its outcome and progress."""

    SCHEMA: ClassVar[int] = 1
    model_path: str
    outcome_url: str
    progress_url: str | None = None


class WorkerSpec(Part):
    """What every rank of a training run is given (``ray_jobs/train/worker.run_worker``), whoever starts it: made from
    a :class:`JobSpec` by the job's driver (the manifests read once there, not by every rank), or by local mode.
    Across Ray Train it travels as its JSON form (Ray Train's ``train_loop_config``, kept in its run's state with the
    config masked) and is parsed again by each rank."""

    config: str  # the run's Config as JSON (masked where Ray Train keeps it; revealed by each rank from its env)
    manifest: DatasetManifest
    model_path: str
    resume_from: str | None = None
    attempt: int = 0
    score_manifest: DatasetManifest | None = None  # the series' pinned eval set the final model is scored on
    parent: str | None = None
    samples: bool = False  # rank 0 writes the sample generations after the export (JobSpec.samples)
    group: int = 0  # the job's row-trace group (tests): a live replica replaced mid-job trains in its peers' group
