"""The root of the tree: a run's name and storage, one section per component, and the checks across sections."""

from __future__ import annotations

from pydantic import field_validator, model_validator

from ray_jobs.config.base import Section
from ray_jobs.config.checkpoint import CheckpointConfig
from ray_jobs.config.cluster import ClusterConfig
from ray_jobs.config.data import DataConfig
from ray_jobs.config.engine import engine_problems
from ray_jobs.config.engines import engine_of
from ray_jobs.config.fault_tolerance import FaultToleranceConfig
from ray_jobs.config.methods import prompts_only
from ray_jobs.config.model import BUILTIN_PREFIX, ModelConfig
from ray_jobs.config.series import (
    PLACEHOLDER,
    PLACEHOLDERS,
    RUN_NAME,
    RUN_NAME_RULE,
    SeriesConfig,
    name_values,
    render_name,
    series_of,
)
from ray_jobs.config.tracking import TrackingConfig
from ray_jobs.config.train import TrainConfig
from ray_jobs.config.tune import TuneConfig, concurrency_problem, trial_name, tune_problems

# Fields newer than the first run records, with their defaults. At its default such a field is left out wherever
# recorded configs are compared -- a recipe's hash (control/series/lineage.py), the fields a resume must keep
# (control/registry.py) -- so a run recorded before the field existed still matches, and resumes.
ADDED_LATER = {
    "train.compile": False,
    "train.export": "merged",
    "model.quantization": "none",
    "train.epochs": None,
    "train.evals_per_epoch": None,
    "checkpoint.saves_per_epoch": None,
    "train.method": "auto",
    "train.rewards": [],
    "data.packing": True,
}


def without_later_defaults(tree: dict) -> dict:
    """A config's dump (or a run record's ``config``) without the :data:`ADDED_LATER` fields that hold their
    default; ``tree`` itself is left as it was."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for dotted, default in ADDED_LATER.items():
        section, _, key = dotted.partition(".")
        part = out.get(section)
        if isinstance(part, dict) and part.get(key, default) == default:
            part.pop(key, None)
    return out


class Config(Section):
    name: str
    """Run name: names the run folder, the Ray Train run and the Ray job submissions. May be a template with
    ``{dataset}`` (short content id of the staged dataset), ``{date}`` (UTC YYYYMMDD), ``{time}`` (UTC HHMMSS),
    resolved once per flow run: ``nightly-{dataset}`` makes every new dataset a new run of series ``nightly``."""
    series: SeriesConfig = SeriesConfig()
    """The lineage of runs this one belongs to: warm starts, the promotion gate and its champion."""
    storage: str
    """Shared storage root, any fsspec URL: a local/NFS path or ``s3://bucket/prefix``."""
    data: DataConfig
    """The training data: where it is, its format, how it is staged and cached."""
    model: ModelConfig = ModelConfig()
    """The base model and how it is adapted (LoRA, 4-bit)."""
    train: TrainConfig = TrainConfig()
    """The training loop: steps, batches, optimizer, precision, the engine, the export."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When checkpoints are taken and how many are kept."""
    cluster: ClusterConfig = ClusterConfig()
    """Where the Ray cluster comes from and how many workers the run has."""
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    """Restarts inside the job and by the watchdog, stall limits, preemption, live recovery."""
    tune: TuneConfig | None = None
    """A hyperparameter search (``unbroken tune``): trials of this config with values drawn from ``tune.space``."""
    tracking: TrackingConfig = TrackingConfig()
    """Experiment trackers the run's metrics also go to: TensorBoard, MLflow, Weights & Biases."""

    @field_validator("name")
    @classmethod
    def _run_name(cls, v: str) -> str:
        unknown = sorted({p for p in PLACEHOLDER.findall(v) if p not in PLACEHOLDERS})
        if unknown:
            known = ", ".join(f"{{{k}}}" for k in PLACEHOLDERS)
            raise ValueError(f"unknown placeholder {', '.join(f'{{{u}}}' for u in unknown)} (known: {known})")
        example = render_name(v, PLACEHOLDERS)
        if not RUN_NAME.fullmatch(example):
            shown = f" (renders like {example!r})" if example != v else ""
            raise ValueError(f"{v!r}{shown} {RUN_NAME_RULE}")
        return v

    @property
    def is_template(self) -> bool:
        return bool(PLACEHOLDER.search(self.name))

    @property
    def workers(self) -> tuple[int, int]:
        """(fewest, most) training processes the job runs: ``cluster.num_workers`` plus live recovery's standbys."""
        extra = self.fault_tolerance.standby_replicas if engine_of(self).standbys else 0
        return self.cluster.min_workers + extra, self.cluster.max_workers + extra

    @property
    def series_name(self) -> str:
        return self.series.name or series_of(self.name)

    def resolved(self, dataset_id: str, at: float) -> Config:
        """This config with its run name template resolved (and its series named, so the run's recorded config
        still knows its series)."""
        return self.named(render_name(self.name, name_values(dataset_id, at)))

    def named(self, run: str) -> Config:
        """This config as the run a template resolved to (known from elsewhere: the series registry)."""
        out = self.model_copy(deep=True)
        out.series.name = self.series_name
        out.name = run
        return out

    @field_validator("storage")
    @classmethod
    def _storage_url(cls, v: str) -> str:
        return _check_url(v)

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.series.name is None and not series_of(self.name):
            raise ValueError(f"series.name: name {self.name!r} is only placeholders; name the series")
        if self.model.lora is not None and self.train.parallelism == "fsdp":
            raise ValueError("model.lora with train.parallelism=fsdp is not supported yet; use ddp for LoRA")
        if prompts_only(self.train.method):  # GRPO samples for one prompt at a time: the final reply's
            self.data.packing, self.data.train_on = False, "last_assistant"
        if problems := engine_problems(self):
            raise ValueError("\n  - ".join(problems))
        if self.fault_tolerance.live_recovery and (p := live_recovery_problem(self)):
            raise ValueError(f"fault_tolerance.live_recovery: {p}")
        problem = batch_split_problem(self.cluster.min_workers, self.cluster.max_workers, self.train.grad_accum_steps)
        if problem:
            raise ValueError(f"cluster.num_workers: {problem}")
        from ray_jobs.storage import is_local  # fsspec, which validating ``storage`` (_check_url) imported already

        if self.tracking.mlflow is not None and not self.tracking.mlflow.tracking_uri and not is_local(self.storage):
            raise ValueError(
                "tracking.mlflow.tracking_uri: required when storage is an object store (MLflow's default "
                "store is a SQLite file under a local storage root)"
            )
        builtin = self.model.name_or_path.startswith(BUILTIN_PREFIX)
        if builtin and self.data.seq_len > self.model.tiny.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.tiny.max_position_embeddings "
                f"({self.model.tiny.max_position_embeddings})"
            )
        if p := run_host_problem(self):
            raise ValueError(p)
        if self.tune is not None:
            problems = tune_problems(self) + self._search_names(self.tune)
            if self.cluster.backend_name == "local" and (p := concurrency_problem(self, local_cpus())):
                problems.append(p + " (a local head has one CPU per core of this machine)")
            if problems:
                raise ValueError("\n  - ".join(problems))
        return self

    @property
    def hosted(self) -> bool:
        """Whether the run's attempts train in a run host (``fault_tolerance.run_host``; never a search's)."""
        return self.fault_tolerance.run_host and self.tune is None

    def _search_names(self, tune: TuneConfig) -> list[str]:
        last = trial_name(render_name(self.name, PLACEHOLDERS), tune.num_trials - 1)
        if RUN_NAME.fullmatch(last):
            return []
        return [f"name: the trials of a search are named <name>-tNN ({last!r}); that {RUN_NAME_RULE}"]


def run_host_problem(cfg: Config) -> str | None:
    """What ``fault_tolerance.run_host`` cannot go with, naming the field: a search, or GCS fault tolerance without it."""
    if cfg.tune is not None and cfg.fault_tolerance.run_host:
        return (
            "fault_tolerance.run_host: not for a search yet (its trials run under Ray Tune's driver, which the search "
            "job owns); set it to false"
        )
    if cfg.cluster.gcs_ft and not cfg.hosted:
        return (
            "cluster.gcs_ft: needs fault_tolerance.run_host: true (the job's driver lives on the head; without a run "
            "host off the head the head's death ends the run all the same)"
        )
    return None


def local_cpus() -> float:
    """What a local head advertises: every core of this machine (it is started without ``--num-cpus``)."""
    import os

    return float(os.cpu_count() or 1)


def live_recovery_problem(cfg: Config) -> str | None:
    """Why live recovery cannot run this config's cluster, or None: a fixed number of workers (Ray Train replaces
    only a replica group of a fixed-size group), at least two, and no best-checkpoint ranking. (What its engine
    cannot run -- FSDP, a 4-bit base -- is its row's in ``ray_jobs/config/engines.py``, checked by
    ``engine_problems``.)"""
    c = cfg.cluster
    if c.elastic:
        return (
            f"needs a fixed cluster.num_workers, not {{min: {c.min_workers}, max: {c.max_workers}}} (Ray Train "
            "replaces a lost replica only in a group of fixed size)"
        )
    if c.max_workers < 2:
        return "needs cluster.num_workers >= 2 (with one worker there is no live peer to keep training or heal from)"
    if cfg.checkpoint.keep_best_by:
        return (
            "keeps the newest checkpoints only: unset checkpoint.keep_best_by (keeping the best needs Ray Train's "
            "checkpoint reports, a barrier over every worker that a replica being replaced would hold up)"
        )
    return None


def batch_split_problem(lo: int, hi: int, grad_accum_steps: int) -> str | None:
    """Why a global batch of ``hi`` x ``grad_accum_steps`` micro-batches cannot be split evenly over every world size
    from ``lo`` to ``hi`` (each worker must run the same number of micro-batches per step), or None."""
    import math

    slots = hi * grad_accum_steps
    bad = [w for w in range(lo, hi + 1) if slots % w]
    if not bad:
        return None
    every = math.lcm(*range(lo, hi + 1))
    need = every // math.gcd(every, hi)  # the smallest grad_accum_steps that splits evenly at every size
    return (
        f"the global batch is {hi} x train.grad_accum_steps={grad_accum_steps} = {slots} micro-batches, which "
        f"{', '.join(map(str, bad))} worker(s) cannot share evenly; set train.grad_accum_steps to a multiple of "
        f"{need}, or narrow min..max"
    )


def _check_url(v: str) -> str:
    import fsspec  # light; only its registry is read

    from ray_jobs.secrets import mask

    v = v.strip()
    if not v:
        raise ValueError("must not be empty")
    # Refused rather than masked: the storage root prefixes every path a run writes, logs and records, so its
    # credentials would have to be masked out of everything and revealed in every process that opens a file.
    # fsspec and boto take them from the environment or a profile instead.
    if mask(v, ()) != v:
        raise ValueError(
            "must not carry credentials (a password in the URL, a secret query parameter): every "
            "path under it is written into run records, job specs and logs; give them to the file "
            "system through its environment or profile (AWS_* variables, ~/.aws/credentials, ~/.netrc)"
        )
    if "://" in v:
        protocol = v.split("://", 1)[0]
        if protocol not in fsspec.registry and protocol not in fsspec.available_protocols():
            raise ValueError(f"unknown storage protocol {protocol!r}")
    return v
