"""Make the base model available on shared storage (building the built-in tiny model when asked for), and check
the model options of a config against it before any cluster work."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from control.logs import run_logger
from ray_jobs.config import Config
from ray_jobs.model.builtin import ensure_base_model, is_builtin


@task(name="prepare-base-model", cache_policy=NO_CACHE)
def prepare_base_model(cfg: Config) -> str:
    """Return where the job loads the base model from: a hub id, a folder, or the built-in model on storage."""
    url, built = ensure_base_model(cfg)
    if built:
        run_logger().info("built %s into %s", cfg.model.name_or_path, url)
    elif is_builtin(cfg.model):
        run_logger().info("built-in base model already on storage: %s", url)
    return url


@task(name="check-model-options", cache_policy=NO_CACHE)
def check_model_options(cfg: Config, model_path: str) -> None:
    """Raise a ConfigError naming the field when ``model.lora`` does not fit the model's layers (only its config is
    read: the module tree is built on the meta device, no weights)."""
    if cfg.model.lora is None:
        return
    from ray_jobs.model.loading import meta_model
    from ray_jobs.model.lora import check_lora

    check_lora(meta_model(model_path), cfg.model.lora, cfg.model.name_or_path)
    run_logger().info("model.lora fits %s", cfg.model.name_or_path)
