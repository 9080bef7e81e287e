"""What a run's Ray job is made of, shipped with every submission (``control/jobs.py``): the module it runs, unbroken's
job code (the ``ray_jobs`` package), the user's Python it imports (``train.rewards``' modules), and the runtime_env
carrying them and the job's variables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from control.backends.base import JOB_ENV
from control.logs import run_logger
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


def user_code(cfg: Config, shipped_before: Callable[[], list[str] | None] | None = None) -> list[str]:
    """The user's Python a run's job imports (``train.rewards``' modules), to ship with it: each module's top-level
    package folder, or its file, found where this process runs. A watchdog elsewhere may not have them: then what
    the run's previous job was shipped (``shipped_before()``: its packages' URIs on the cluster) goes again, and when
    that cannot be had either, the job goes without them -- said here; its workers then fail to import them, as the
    user's mistake (named, not retried)."""
    from ray_jobs.config.train import code_path

    found, missing = set(), []
    for module in sorted({r.function.partition(":")[0] for r in cfg.train.rewards}):
        try:
            found.add(code_path(module))
        except ValueError:
            missing.append(module)
    if missing and shipped_before is not None and (before := shipped_before()):
        return sorted(found | set(before))
    if missing:
        run_logger().warning(
            "run %s: %s not found here, nor shipped with a job the cluster still has: the job goes without it",
            cfg.name,
            ", ".join(missing),
        )
    return sorted(found)


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
