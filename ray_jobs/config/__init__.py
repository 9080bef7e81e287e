"""The one typed config tree for a run: YAML on disk, ``--set a.b=c`` overrides, validated once.

Lives in ``ray_jobs`` because the Ray job needs it and Prefect is not installed on workers; flows and tasks
import it from here. Every problem in a config is reported in one :class:`ConfigError` naming each field, and
loading never touches storage or a cluster.

One module per component, as torchtitan splits its job config: ``data``, ``model``, ``train``, ``checkpoint``,
``cluster``, ``fault_tolerance``, ``series`` (and run names), ``run`` (the root :class:`Config` and the checks across
sections) and ``loading`` (YAML, overrides, validation, JSON). Import the names from here.
"""

from ray_jobs.config.base import ConfigError
from ray_jobs.config.checkpoint import CheckpointConfig
from ray_jobs.config.cluster import (
    BackendName,
    ClusterConfig,
    KubeRayConfig,
    RayUpConfig,
    WorkerRange,
    cluster_problems,
)
from ray_jobs.config.data import DataConfig
from ray_jobs.config.fault_tolerance import FaultToleranceConfig, PhaseStallConfig
from ray_jobs.config.loading import absolute_url, from_json, job_spec, load_config, parse_overrides, validate
from ray_jobs.config.model import BUILTIN_MODELS, BUILTIN_PREFIX, LoraConfig, ModelConfig, TinyModelConfig
from ray_jobs.config.run import ADDED_LATER, Config, batch_split_problem, without_later_defaults
from ray_jobs.config.series import (
    PLACEHOLDERS,
    RUN_NAME,
    RUN_NAME_RULE,
    SeriesConfig,
    name_values,
    render_name,
    series_of,
)
from ray_jobs.config.tracking import MLflowConfig, TensorBoardConfig, TrackingConfig, WandbConfig
from ray_jobs.config.train import TrainConfig
from ray_jobs.config.tune import TuneConfig, fitting_trials, trial_name, trial_values

__all__ = [
    "ADDED_LATER", "BUILTIN_MODELS", "BUILTIN_PREFIX", "PLACEHOLDERS", "RUN_NAME", "RUN_NAME_RULE", "BackendName",
    "CheckpointConfig", "ClusterConfig", "Config", "ConfigError", "DataConfig", "FaultToleranceConfig", "KubeRayConfig",
    "LoraConfig",
    "MLflowConfig", "ModelConfig", "PhaseStallConfig", "RayUpConfig", "SeriesConfig", "TensorBoardConfig",
    "TinyModelConfig", "TrackingConfig", "TrainConfig", "TuneConfig", "WandbConfig",
    "WorkerRange", "absolute_url", "batch_split_problem", "cluster_problems", "fitting_trials", "from_json",
    "job_spec", "load_config", "name_values", "parse_overrides", "render_name", "series_of", "trial_name",
    "trial_values", "validate", "without_later_defaults",
]  # fmt: skip
