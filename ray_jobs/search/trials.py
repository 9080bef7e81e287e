"""The trials of a search, from its config alone: names, values and the config each trains with."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from ray_jobs.config import Config, trial_name, trial_values
from ray_jobs.config.tune import set_field
from ray_jobs.storage import Layout, read_json

# A trial's states in ``runs/<search>/trials.json`` (ray_jobs/search/progress.py); the last three are final.
TRIAL_STATES = ("pending", "running", "completed", "stopped-early", "failed")
DONE = TRIAL_STATES[2:]


@dataclass(frozen=True)
class Trial:
    index: int
    name: str  # a run of the search's series: ``<search>-t<NN>``
    params: dict[str, Any]  # field -> the value drawn for it
    config: Config  # the search's config with the values set, no ``tune`` section: a plain run's


def trials(cfg: Config) -> list[Trial]:
    """Every trial of the search ``cfg`` (its name resolved), in order; the same list wherever it is computed."""
    if cfg.tune is None:
        raise ValueError(f"run {cfg.name!r} has no tune section")
    base = json.loads(cfg.model_dump_json())
    base["tune"] = None
    base["series"]["name"] = cfg.series_name  # trials are runs of the search's series
    out = []
    for i, values in enumerate(trial_values(cfg.tune)):
        tree = copy.deepcopy(base)
        tree["name"] = trial_name(cfg.name, i)
        for field, value in values.items():
            set_field(tree, field, value)
        out.append(Trial(i, tree["name"], values, Config.model_validate(tree)))
    return out


def read_trials(storage: str, search: str) -> dict[str, Any] | None:
    """``runs/<search>/trials.json`` as the search job last wrote it, or None before it did."""
    try:
        return read_json(Layout(storage).search_trials(search))
    except (FileNotFoundError, ValueError):
        return None


def trial_states(storage: str, search: str) -> dict[str, dict[str, Any]]:
    """Trial run name -> what trials.json says of it (none before the search job wrote it)."""
    return (read_trials(storage, search) or {}).get("trials", {})
