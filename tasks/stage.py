"""Stage the dataset onto shared storage (a content-addressed cache hit when nothing changed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.model.loading import load_tokenizer
from tasks.logs import run_logger


@dataclass
class Staged:
    dataset_id: str
    manifest_url: str
    cache_hit: bool
    counts: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@task(name="stage-dataset", cache_policy=NO_CACHE)
def stage_dataset(cfg: Config, model_path: str) -> Staged:
    """Validate, tokenize and pack ``data.train`` into Parquet shards + manifest under ``<storage>/datasets``."""
    log = run_logger()
    try:
        tokenizer = load_tokenizer(model_path, cfg.data.cache_dir)
    except (OSError, ValueError) as e:
        raise StagingError(f"model.name_or_path: cannot load a tokenizer from {model_path}: {e}") from e
    result = stage(cfg.data, tokenizer, model_path, cfg.storage)
    counts = result.manifest["counts"]
    verb = "cache hit" if result.cache_hit else "staged"
    log.info(
        "%s dataset %s: %d records (%d rejected) -> %d train / %d eval rows; manifest %s",
        verb, result.dataset_id, counts["records"], counts["rejects"], counts["train_rows"], counts["eval_rows"],
        result.manifest_url,
    )  # fmt: skip
    return Staged(result.dataset_id, result.manifest_url, result.cache_hit, counts)
