"""The trials of a search, from its config alone: names, values and the config each trains with."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from pydantic import JsonValue

from ray_jobs.config import Config, trial_name, trial_values
from ray_jobs.config.tune import set_field
from ray_jobs.contracts.trials import TrialEntry, Trials
from ray_jobs.storage import Layout


@dataclass(frozen=True)
class Trial:
    index: int
    name: str  # a run of the search's series: ``<search>-t<NN>``
    params: dict[str, JsonValue]  # field -> the value drawn for it
    config: Config  # the search's config with the values set, no ``tune`` section: a plain run's


def trials(cfg: Config) -> list[Trial]:
    """Every trial of the search ``cfg`` (its name resolved), in order; the same list wherever it is computed."""
    if cfg.tune is None:
        raise ValueError(f"run {cfg.name!r} has no tune section")
    base = json.loads(cfg.model_dump_json())
    base["tune"] = None
    base["series"]["name"] = cfg.series_name  # trials are runs of the search's series
    base["fault_tolerance"]["run_host"] = False  # trained under Ray Tune's driver, never in a run host
    out = []
    for i, values in enumerate(trial_values(cfg.tune)):
        tree = copy.deepcopy(base)
        tree["name"] = trial_name(cfg.name, i)
        for field, value in values.items():
            set_field(tree, field, value)
        out.append(Trial(i, tree["name"], values, Config.model_validate(tree)))
    return out


def read_trials(storage: str, search: str) -> Trials | None:
    """``runs/<search>/trials.json`` as the search job last wrote it, or None before it did (or while it cannot be
    read: torn, or a newer release's -- the next write of the driver replaces it)."""
    try:
        return Trials.read(Layout(storage).search_trials(search))
    except ValueError:  # RecordError is one
        return None


def trial_states(storage: str, search: str) -> dict[str, TrialEntry]:
    """Trial run name -> what trials.json says of it (none before the search job wrote it)."""
    found = read_trials(storage, search)
    return found.trials if found else {}
