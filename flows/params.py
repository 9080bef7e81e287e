"""A finetune flow run's parameters -> the config it trains with. Shared by the flow, its run name and its
cancellation hooks (which find the run's registry from the flow run's parameters)."""

from __future__ import annotations

from control.config import Config, load_config, validate
from control.sources import check_allowed_source
from ray_jobs.config.loading import raw_config
from ray_jobs.secrets import reveal


def run_config(config_path: str | None, overrides: list[str] | None = None, dataset_uri: str | None = None) -> Config:
    """The file, its overrides, and ``data.train`` from a dataset event's payload -- which must fall under the
    served config's ``data.allowed_sources`` (SourceRefused otherwise: an event cannot point a run at any file
    or URL the flow's machine can read)."""
    cfg = load_config(config_path, overrides)
    if not dataset_uri:
        return cfg
    dataset_uri = reveal(dataset_uri)  # an event names a source masked (flows/sensor.py); its credentials are ours
    uri = check_allowed_source(cfg, dataset_uri)
    # Set as the string it is, never as a ``data.train=...`` override: an override's value is YAML, so the URI
    # "'/etc/passwd'" (a relative path under the allowed working folder) would become /etc/passwd.
    raw = raw_config(config_path, overrides)
    data = raw.get("data")
    raw["data"] = {**(data if isinstance(data, dict) else {}), "train": uri}
    run = validate(raw, str(config_path or "config"))
    assert isinstance(run.data.train, str), "an event's URI is data.train's one source, a string"
    check_allowed_source(cfg, run.data.train)  # what staging will read, as validation resolved it
    return run
