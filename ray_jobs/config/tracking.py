"""``tracking``: the experiment trackers a run's metrics also go to (TensorBoard, MLflow, Weights & Biases).

Each is off unless named: ``tracking.tensorboard: true`` takes its defaults, a mapping sets them. Whatever the
tracker, one run of ours is one run there, each logged step once, across every restart (see
``ray_jobs/train/tracking``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from ray_jobs.config.base import Section


class TensorBoardConfig(Section):
    dir: str | None = None
    """Folder of the event files; unset: ``<storage>/runs/<run>/tensorboard``. On an object store the files are
    written on the node and copied up after each write (the writer appends to a file, which object stores cannot)."""


class MLflowConfig(Section):
    tracking_uri: str | None = None
    """MLflow tracking URI (``http://...``, ``sqlite:///...``); unset: a SQLite database ``<storage>/mlflow.db`` for
    local storage (required on an object store)."""
    experiment: str | None = None
    """Experiment name; unset: the run's series."""


class WandbConfig(Section):
    project: str | None = None
    """W&B project; unset: the run's series."""
    mode: Literal["offline", "online"] = "offline"
    """``offline`` writes a local run folder (``wandb sync`` uploads it later); ``online`` needs the network and
    ``WANDB_API_KEY`` on the workers."""
    dir: str | None = None
    """Where the run folder goes (on the node running rank 0); unset: ``<storage>/runs/<run>/wandb`` for local
    storage, else a folder under the system's temp dir."""


def _on(v: Any) -> Any:
    """``true`` means the defaults, ``false``/absent means off."""
    if v is True:
        return {}
    if v is False:
        return None
    return v


class TrackingConfig(Section):
    tensorboard: TensorBoardConfig | None = None
    """TensorBoard event files (``true`` for the defaults)."""
    mlflow: MLflowConfig | None = None
    """An MLflow run per run: params (the flattened config), tags (dataset, parent run, attempt), metrics per step,
    the final model folder linked (``true`` for the defaults)."""
    wandb: WandbConfig | None = None
    """A Weights & Biases run per run, offline by default (``true`` for the defaults)."""

    @field_validator("*", mode="before")
    @classmethod
    def _switch(cls, v: Any) -> Any:
        return _on(v)

    @property
    def enabled(self) -> list[str]:
        """The trackers switched on, by their section's name (each is ``ray_jobs/train/tracking/<name>.py``'s
        ``TRACKER``)."""
        return [name for name in type(self).model_fields if getattr(self, name) is not None]
