"""The staging flow on its own: prepare the base model's tokenizer, then stage the dataset."""

from __future__ import annotations

from typing import Any

from prefect import flow

from ray_jobs.config import load_config
from tasks.model import prepare_base_model
from tasks.stage import stage_dataset


@flow(name="stage-dataset")
def stage_flow(config_path: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Stage ``data.train`` to ``<storage>/datasets/<id>``; returns the dataset id and manifest URL."""
    cfg = load_config(config_path, overrides or [])
    return stage_dataset(cfg, prepare_base_model(cfg)).to_dict()
