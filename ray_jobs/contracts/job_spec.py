"""What the control plane gives a job on the cluster, on shared storage (the job's only argument is its URL):
written by ``control/jobs.py`` (training, search) and ``tasks/stage.py`` (staging), read by the job's entrypoint
through ``ray_jobs.config.loading.job_spec``. The config travels whole, as its JSON tree, and is validated again
where it is read (``ray_jobs.config.from_json``): a job never trusts a file for its types."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import JsonValue

from ray_jobs.contracts.base import Part, Record
from ray_jobs.contracts.dataset import DatasetManifest


class Spec(Record):
    """What every job's spec holds: the run's config."""

    config: dict[str, JsonValue]  # the run's Config as JSON (credentials masked; revealed where the job reads it)


class AttemptInputs(Part):
    """What one attempt of a run is given besides its config, its number and where it resumes -- declared here once:
    the finetune flow makes it (``tasks/record.py``), the run record keeps it (``RunRecord.inputs``: what the watchdog
    resubmits without the flow, and a search's trials share), the job spec carries it (:class:`JobSpec`), and every
    rank is given it (:class:`WorkerSpec`). A new input of an attempt is one field here."""

    manifest_url: str  # the staged dataset
    model_path: str  # the weights to start from: the base model, or a warm start's folder
    score_manifest_url: str | None = None  # the series' pinned eval set the finished model is scored on
    parent: str | None = None  # the series run it warm-starts from (its trackers tag the run with it)
    samples: bool = False  # write runs/<run>/samples.json after the export (the finetune flow's summary publishes it)


class JobSpec(Spec):
    """A training job's or a search's: the attempt's inputs, the checkpoint to resume (None: the newest valid one,
    or a fresh start) and the attempt it is. Version 2: the inputs as one part (version 1 had them at the top)."""

    SCHEMA: ClassVar[int] = 2
    inputs: AttemptInputs
    resume_from: str | None = None
    attempt: int = 0

    @classmethod
    def migrate(cls, tree: dict[str, Any]) -> dict[str, Any]:
        if tree.get("schema_version", 1) == 1:  # v1 -> v2: the inputs' fields gathered into ``inputs``
            tree["inputs"] = {k: tree.pop(k) for k in list(AttemptInputs.model_fields) if k in tree}
            tree["schema_version"] = 2
        return tree


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
    inputs: AttemptInputs
    manifest: DatasetManifest  # ``inputs.manifest_url``'s, read once by the driver
    score_manifest: DatasetManifest | None = None  # ``inputs.score_manifest_url``'s
    resume_from: str | None = None
    attempt: int = 0
    group: int = 0  # the job's row-trace group (tests): a live replica replaced mid-job trains in its peers' group
