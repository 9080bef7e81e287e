"""A finetune flow run's parameters -> the config it trains with. Shared by the flow, its run name and its
cancellation hooks (which find the run's registry from the flow run's parameters)."""

from __future__ import annotations

from control.config import Config, load_config
from control.sources import check_allowed_source


def run_config(config_path: str | None, overrides: list[str] | None = None, dataset_uri: str | None = None) -> Config:
    """The file, its overrides, and ``data.train`` from a dataset event's payload -- which must fall under the
    served config's ``data.allowed_sources`` (SourceRefused otherwise: an event cannot point a run at any file
    or URL the flow's machine can read)."""
    cfg = load_config(config_path, overrides)
    if not dataset_uri:
        return cfg
    uri = check_allowed_source(cfg, dataset_uri)
    return load_config(config_path, [*(overrides or []), f"data.train={uri}"])
