"""Make the base model available on shared storage (building the built-in tiny model when asked for), and check
the model options of a config against it before any cluster work."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config, ConfigError
from ray_jobs.model.builtin import build_builtin, builtin_name, is_builtin
from ray_jobs.storage import Layout, exists, join, upload_dir
from tasks.logs import run_logger


def base_model_ready(cfg: Config) -> bool:
    """Whether the base model is there to load: always for a hub id or a folder; for the built-in model, whether it
    was built on this storage already (when not, no run on this storage can have trained on it yet)."""
    return not is_builtin(cfg.model) or exists(join(_builtin_url(cfg), "README.md"))


def _builtin_url(cfg: Config) -> str:
    return Layout(cfg.storage).model_dir(builtin_name(cfg.model, cfg.train.seed))


@task(name="prepare-base-model", cache_policy=NO_CACHE)
def prepare_base_model(cfg: Config) -> str:
    """Return where the job loads the base model from: a hub id, a folder, or the built-in model on storage."""
    if not is_builtin(cfg.model):
        check_local_folder(cfg.model.name_or_path)
        return cfg.model.name_or_path
    log = run_logger()
    url = _builtin_url(cfg)
    if base_model_ready(cfg):
        log.info("built-in base model already on storage: %s", url)
        return url
    with tempfile.TemporaryDirectory(prefix="unbroken-model-") as d:
        build_builtin(cfg.model, cfg.train.seed, d)
        upload_dir(d, url)
    log.info("built %s into %s", cfg.model.name_or_path, url)
    return url


def check_local_folder(name_or_path: str) -> None:
    """A path-like model (``/x``, ``./x``, ``~/x``, ``.unbroken/...``) must exist: otherwise transformers would take
    it for a hub id and fail with a hub error that never names the field."""
    if "://" in name_or_path or not name_or_path.startswith(("/", ".", "~")):
        return  # a hub id (org/name) or a storage URL, checked where it is read
    if not Path(name_or_path).expanduser().is_dir():
        hint = " (run `make smollm2` to build it)" if "smollm2" in name_or_path else ""
        raise ConfigError([f"model.name_or_path: no such model folder: {name_or_path}{hint}"])


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
