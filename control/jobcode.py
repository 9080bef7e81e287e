"""What a run's Ray job is made of, shipped with every submission (``control/jobs.py``): the module it runs, unbroken's
job code (the ``ray_jobs`` package), the user's Python it imports (``train.rewards``' modules), and the runtime_env
carrying them and the job's variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from control.backends.base import JOB_ENV
from ray_jobs.config import Config


def job_code() -> Path:
    """What a job runs, shipped to the cluster with every job (runtime_env ``py_modules``): the ``ray_jobs`` package,
    which imports nothing else of unbroken (tests/unit/test_architecture.py) -- wherever it is installed. Not the
    folder around it: from a plain ``pip install .`` that is site-packages, every library of the environment."""
    import ray_jobs

    return Path(ray_jobs.__file__).resolve().parent


# What never travels with it: bytecode (each Python compiles its own).
JOB_CODE_EXCLUDES = ["**/__pycache__/", "*.pyc"]


def entrypoint(cfg: Config) -> str:
    """The module a run's job runs: a hyperparameter search's driver, or the training job."""
    return "ray_jobs.search_job" if cfg.tune is not None else "ray_jobs.job"


def user_code(cfg: Config) -> list[str]:
    """The user's Python a run's job imports (``train.rewards``' modules), as local paths to ship with it: each
    module's top-level package folder, or its file."""
    from ray_jobs.config.train import code_path

    return sorted({code_path(r.function.partition(":")[0]) for r in cfg.train.rewards})


def runtime_env(submission_id: str, env: dict[str, str] | None, code: list[str]) -> dict[str, Any]:
    """A job's runtime_env: the job's code (``job_code``, and the user's), and ``env`` over the variables every job
    gets."""
    # Every process of the job (the driver, its wrapper, each worker) carries its submission id in its
    # environment: on a local head, what the job left behind is found by it and by nothing else (JOB_ENV).
    # RUST_LOG: torchft (live recovery) logs every quorum at INFO from Rust, in the workers and its lighthouse.
    return {
        "py_modules": [str(job_code()), *code],
        "excludes": JOB_CODE_EXCLUDES,
        "env_vars": {"RAY_LOGGER_LEVEL": "info", "RUST_LOG": "warn", **(env or {}), JOB_ENV: submission_id},
    }
