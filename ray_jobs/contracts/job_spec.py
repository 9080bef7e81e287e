"""What the control plane gives a job on the cluster, on shared storage (the job's only argument is its URL):
written by ``control/jobs.py`` (training, search) and ``tasks/stage.py`` (staging), read by the job's entrypoint
through ``ray_jobs.config.loading.job_spec``. The config travels whole, as its JSON tree, and is validated again
where it is read (``ray_jobs.config.from_json``): a job never trusts a file for its types."""

from __future__ import annotations

from typing import Any, ClassVar

from ray_jobs.contracts.base import Record


class Spec(Record):
    """What every job's spec holds: the run's config."""

    config: dict[str, Any]  # the run's Config as JSON (credentials masked; revealed where the job reads it)


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


class StageSpec(Spec):
    """A staging job's: the config, the tokenizer's model, and where the job writes its outcome and progress."""

    SCHEMA: ClassVar[int] = 1
    model_path: str
    outcome_url: str
    progress_url: str | None = None
