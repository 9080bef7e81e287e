"""Loading a run's config where runs are controlled (the CLI, the flows, the served deployments): ray_jobs' loading
(the typed tree, every section's own checks), then the checks of the cluster backend it names (control/backends: a
``ray up`` YAML read from disk, what KubeRay pods need) -- all in one ConfigError naming every field. ray_jobs cannot
run the backends' checks itself: it runs on the cluster and never imports the control plane.

``from_json`` (a config stored with a run or a job spec) is ray_jobs' own: it was checked when it was first loaded,
and a watchdog reading a run's config back must not fail because a cluster YAML moved since."""

from __future__ import annotations

import os

from control.backends import backend_problems
from ray_jobs.config import Config, ConfigError, from_json, loading
from ray_jobs.config.epochs import steps_problems

__all__ = ["Config", "ConfigError", "from_json", "load_config", "validate"]


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (optional), apply ``--set`` overrides, validate; raises ConfigError naming every bad field."""
    return validate(loading.raw_config(path, overrides), str(path or "config"))


def validate(raw: loading.RawTree, source: str = "config") -> Config:
    """A raw tree validated by ray_jobs, with its cluster backend's problems added to the same error (also when
    other sections have errors of their own: every problem is reported at once)."""
    cfg: Config | None = None
    problems: list[str] = []
    try:
        cfg = loading.validate(raw, source)
    except ConfigError as e:
        problems = list(e.problems)
    problems += steps_problems(raw)
    cluster = loading.cluster_alone(raw)
    if cluster is not None:  # judged as written (paths not yet made absolute): messages quote what the user wrote
        problems += backend_problems(cluster, str(raw.get("storage") or ""))
    if problems:
        raise ConfigError(problems, source)
    assert cfg is not None, "loading.validate returns a Config or raises ConfigError with at least one problem"
    return cfg


def check_flow(cfg: Config, search: bool, source: str = "config") -> None:
    """A config with a ``tune`` section is a hyperparameter search (``unbroken tune``, the tune flow); any other is
    one run (``unbroken run``, the finetune flow). ConfigError naming ``tune`` when the command does not fit."""
    if search and cfg.tune is None:
        raise ConfigError(["tune: the config has no tune section; add one (see configs/demo-tune.yaml)"], source)
    if not search and cfg.tune is not None:
        raise ConfigError(
            ["tune: the config is a hyperparameter search; run it with `unbroken tune` (the tune flow)"], source
        )
