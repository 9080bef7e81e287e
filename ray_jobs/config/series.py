"""``series`` and run names: the lineage a run belongs to, and the run name templates that resolve per dataset."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from ray_jobs.config.base import Section

RUN_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
RUN_NAME_RULE = "must be 1-63 lowercase letters, digits or '-', starting with a letter or digit"
# What a run name template may say, and a value of each one's shape (to check a template renders to a valid name).
PLACEHOLDERS = {"dataset": "0123abcd", "date": "20261123", "time": "235959"}
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class SeriesConfig(Section):
    name: str | None = None
    """The lineage this run belongs to; default: ``name`` with its placeholders (and the separators around them)
    removed, so ``nightly-{dataset}`` is series ``nightly``."""
    eval: str | None = None
    """The series' fixed eval set (JSONL/Parquet file or folder, like ``data.train``), staged once and pinned by its
    dataset id; every finished run is scored on it. Default: the eval split of the series' first run, pinned."""
    min_improvement: float = Field(0.0, ge=0, lt=1)
    """A run becomes champion only if its score beats the champion's by this fraction (0.01 = 1 % lower loss)."""
    keep_runs: int | None = Field(None, ge=1)
    """Keep the final models of at most this many succeeded non-champion runs (oldest deleted first); None = all."""

    @field_validator("name")
    @classmethod
    def _series_name(cls, v: str | None) -> str | None:
        if v is not None and not RUN_NAME.fullmatch(v):
            raise ValueError(f"{v!r} {RUN_NAME_RULE}")
        return v


def render_name(template: str, values: dict[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def series_of(template: str) -> str:
    """``nightly-{dataset}`` -> ``nightly``: the placeholders and the separators around them removed."""
    parts = [p.strip("-") for p in PLACEHOLDER.split(template)[::2]]
    return "-".join(p for p in parts if p)


def name_values(dataset_id: str, at: float) -> dict[str, str]:
    """What a run name template's placeholders resolve to for a dataset, at a time (UTC)."""
    import time

    t = time.gmtime(at)
    return {
        "dataset": dataset_id.removeprefix("ds-")[:8],
        "date": time.strftime("%Y%m%d", t),
        "time": time.strftime("%H%M%S", t),
    }
