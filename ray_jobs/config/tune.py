"""``tune``: a hyperparameter search (Ray Tune) over fields of the run's own config.

Every trial is a run of the series, named ``<run>-t<NN>``, training the run's config with the trial's values set.
The trials are drawn here, from ``tune.seed``, before anything runs (see :func:`trials`): the flow records them,
the search job runs them and a restored search finds them again, all from the config alone.
"""

from __future__ import annotations

import math
import random
from typing import Any, Literal

from pydantic import Field, JsonValue, ValidationError, field_validator

from ray_jobs.config.base import Section

DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")
# Sections a search may set fields of. ``data`` fields are refused one by one below: every one that shapes training
# rows is part of the dataset id (ray_jobs/data/staging.py, ``staging_config``), and a search trains every trial on
# the one dataset staged for it, so that the trials' scores compare.
SEARCHABLE = ("train.", "model.lora.", "data.")
NOT_SEARCHABLE = {"train.max_steps": "every trial trains the same steps (ASHA stops the ones that fall behind)"}


class TuneConfig(Section):
    space: dict[str, JsonValue]
    """Field -> distribution, e.g. ``train.lr: {loguniform: [1.0e-4, 1.0e-2]}``. Distributions: ``choice: [a, b]``,
    ``uniform: [lo, hi]``, ``loguniform: [lo, hi]`` (lo > 0), ``randint: [lo, hi]`` (lo <= n < hi, as Ray Tune's).
    Fields: any of ``train.*`` (but ``max_steps``) and ``model.lora.*``; no ``data.*`` field, since each one that
    changes training rows changes the dataset id and every trial trains on the one staged dataset."""
    num_trials: int = Field(4, ge=1, le=99)
    """Trials to run, drawn from ``space`` with ``seed``."""
    max_concurrent_trials: int | None = Field(None, ge=1)
    """Trials training at once; default: as many as the cluster fits (``cluster.num_workers`` x ``cpus_per_worker``
    each). 1 makes the search's early stops, and so its winner, the same on every run of it."""
    metric: Literal["eval_loss"] = "eval_loss"
    """What trials are compared by (lower is better): the eval loss each trial reports with its checkpoints."""
    scheduler: Literal["asha", "fifo"] = "asha"
    """``asha``: Ray Tune's asynchronous successive halving stops trials that fall behind at each rung; ``fifo``:
    every trial trains to ``train.max_steps``."""
    grace_period_steps: int = Field(100, ge=1)
    """``asha``: no trial is stopped before this step; rungs at grace x reduction_factor^k steps."""
    reduction_factor: float = Field(2.0, gt=1)
    """``asha``: at each rung, trials worse than the best 1/reduction_factor of those seen there are stopped."""
    seed: int = 0
    """Seed of the draws of every trial's values (each trial trains with ``train.seed`` as set, or as drawn)."""

    @field_validator("space", mode="before")
    @classmethod
    def _flat(cls, v: Any) -> Any:
        """``--set tune.space.train.lr=...`` nests by its dots: the same space as the flat ``train.lr`` key."""
        return flatten(v) if isinstance(v, dict) else v


def flatten(tree: dict[str, JsonValue], prefix: str = "") -> dict[str, JsonValue]:
    out: dict[str, JsonValue] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        # a section of fields (``{train: {lr: {...}}}``), not a distribution (``{name: [args]}``)
        if isinstance(value, dict) and not (len(value) == 1 and isinstance(next(iter(value.values())), list)):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


def distribution(field: str, spec: Any) -> tuple[str, list[Any]]:
    """``(kind, args)`` of one field's distribution; ValueError naming ``tune.space.<field>`` when malformed."""
    where = f"tune.space.{field}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ValueError(f"{where}: expected one of {{{': ..., '.join(DISTRIBUTIONS)}: ...}}, got {spec!r}")
    kind, args = next(iter(spec.items()))
    if not isinstance(args, list) or not args:
        raise ValueError(f"{where}: {kind} takes a list, got {args!r}")
    if kind == "choice":
        return kind, args
    if len(args) != 2 or not all(isinstance(a, int | float) and not isinstance(a, bool) for a in args):
        raise ValueError(f"{where}: {kind} takes [lo, hi] numbers, got {args!r}")
    lo, hi = args
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise ValueError(f"{where}: randint takes integers, got {args!r}")
    if not lo < hi:
        raise ValueError(f"{where}: the range [{lo}, {hi}] is empty (lo must be below hi)")
    if kind == "loguniform" and lo <= 0:
        raise ValueError(f"{where}: loguniform needs lo > 0, got {lo}")
    return kind, args


def draw(kind: str, args: list[Any], rng: random.Random) -> JsonValue:
    if kind == "choice":
        return args[rng.randrange(len(args))]
    lo, hi = args
    if kind == "uniform":
        return rng.uniform(lo, hi)
    if kind == "loguniform":
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.randrange(lo, hi)


def trial_values(tune: TuneConfig) -> list[dict[str, JsonValue]]:
    """Every trial's values, drawn in order from ``tune.seed``: trial ``i``'s are the same wherever they are drawn
    (why the draws are ours, not Ray Tune's search algorithm: the flow records the trials as runs before the search
    starts, and a restored search must run exactly those)."""
    rng = random.Random(tune.seed)
    fields = sorted(tune.space)
    specs = {f: distribution(f, tune.space[f]) for f in fields}
    return [{f: draw(*specs[f], rng) for f in fields} for _ in range(tune.num_trials)]


def trial_name(run: str, index: int) -> str:
    return f"{run}-t{index:02d}"


def set_field(tree: dict[str, JsonValue], dotted: str, value: JsonValue) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        section = tree[part]
        assert isinstance(section, dict), f"{part} of {dotted} is a section of the config"
        tree = section
    tree[leaf] = value


def tune_problems(cfg: Any) -> list[str]:
    """What makes ``cfg.tune`` unusable with this config, each naming its field (the root's cross-section check)."""
    t, problems = cfg.tune, []
    for field in sorted(t.space):
        try:
            kind, args = distribution(field, t.space[field])
            _check_field(cfg, field, kind, args)
        except ValueError as e:
            problems.append(str(e))
    if t.scheduler == "asha":
        if t.grace_period_steps > cfg.train.max_steps:
            problems.append(
                f"tune.grace_period_steps: {t.grace_period_steps} is above train.max_steps "
                f"({cfg.train.max_steps}); no trial could ever be stopped early"
            )
        every, evals = cfg.checkpoint.every_steps, cfg.train.eval_every_steps
        if every == 0 or every % evals:
            problems.append(
                f"checkpoint.every_steps: {every} must be a multiple of train.eval_every_steps ({evals}) "
                "with tune.scheduler asha: ASHA judges a trial by the eval loss it reports with each "
                "checkpoint, which must be that step's"
            )
    return problems


def _check_field(cfg: Any, field: str, kind: str, args: list[Any]) -> None:
    """ValueError naming ``tune.space.<field>`` when the field cannot be searched or a value does not fit it."""
    where = f"tune.space.{field}"
    if field.startswith("data."):
        raise ValueError(
            f"{where}: data fields cannot be searched: each one that shapes training rows changes the "
            "dataset id, and every trial trains on the one dataset staged for the search"
        )
    if field in NOT_SEARCHABLE:
        raise ValueError(f"{where}: cannot be searched: {NOT_SEARCHABLE[field]}")
    if not field.startswith(SEARCHABLE):
        raise ValueError(f"{where}: only train.* and model.lora.* fields can be searched")
    *parents, leaf = field.split(".")
    section = cfg
    for part in parents:
        section = getattr(section, part, None)
        if section is None:
            what = ".".join(parents)
            raise ValueError(f"{where}: {what} is not set; set {what} in the config to search its fields")
    info = type(section).model_fields.get(leaf)
    if info is None:
        raise ValueError(f"{where}: unknown field {leaf!r} of {'.'.join(parents)}")
    if info.annotation is int and kind in ("uniform", "loguniform"):
        raise ValueError(f"{where}: {kind} draws fractions and the field takes whole numbers; use randint or choice")
    values = args if kind == "choice" else [args[0], args[1] - 1 if kind == "randint" else args[1]]
    for value in values:
        tree = cfg.model_dump()
        tree["tune"] = None
        set_field(tree, field, value)
        try:
            type(cfg).model_validate(tree)
        except ValueError as e:  # pydantic's ValidationError: the field's own message
            why = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
            raise ValueError(f"{where}: {value!r} is not a valid value: {why}") from None


def concurrency_problem(cfg: Any, cpus: float) -> str | None:
    """Why ``tune.max_concurrent_trials`` trials can never train at once on ``cpus`` CPUs, or None."""
    c, t = cfg.cluster, cfg.tune
    each = c.min_workers * c.cpus_per_worker
    if t.max_concurrent_trials is None or t.max_concurrent_trials * each <= cpus:
        return None
    return (
        f"tune.max_concurrent_trials: {t.max_concurrent_trials} trials x cluster.num_workers={c.min_workers} x "
        f"cluster.cpus_per_worker={c.cpus_per_worker:g} need {t.max_concurrent_trials * each:g} CPUs; the cluster "
        f"has {cpus:g}, so at most {int(cpus // each)} can train at once"
    )


def fitting_trials(cfg: Any, cpus: float) -> int:
    """How many trials the cluster fits at once (at least 1: a run too big for the cluster is refused elsewhere)."""
    c = cfg.cluster
    return max(1, min(cfg.tune.num_trials, int(cpus // (c.min_workers * c.cpus_per_worker))))
