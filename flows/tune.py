"""The tune flow: a hyperparameter search (``tune:`` in the config) run like a finetune -- stage once, provision
once, one Ray job (``ray_jobs/search_job.py``) submitted through the Jobs API and watched, each trial a run of the
series, the winner put to the promotion gate. A failed search job is left to the watchdog, which resubmits it; the
search then restores its experiment from storage.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import State

from control.config import ConfigError, check_flow
from control.sources import SourceRefused
from control.summaries import RunSummary, SearchSummary
from flows.cancel import one_run_per_series, stop_on_cancel, stop_on_crash
from flows.finetune import finetune_body
from flows.params import run_config


def tune_run_name() -> str:
    """``tune-<search name>``, findable by name in the UI."""
    try:
        cfg = run_config(**flow_run.parameters)
    except (ConfigError, SourceRefused, OSError):
        return "tune-invalid-config"
    return f"tune-{cfg.series_name if cfg.is_template else cfg.name}"


@flow(name="tune", flow_run_name=tune_run_name, on_cancellation=[stop_on_cancel], on_crashed=[stop_on_crash])
async def tune(
    config_path: str | None = None, overrides: list[str] | None = None
) -> RunSummary | SearchSummary | State:
    """Search hyperparameters with Ray Tune over the config's ``tune.space``; returns the trials and the winner."""
    cfg = run_config(config_path, overrides)
    check_flow(cfg, search=True, source=str(config_path or "config"))
    async with one_run_per_series(cfg.series_name):
        return await finetune_body(cfg)
