"""The staging flow on its own: prepare the base model's tokenizer, then stage the dataset (here or on the cluster)."""

from __future__ import annotations

from prefect import flow

from control.config import Config, load_config
from tasks.cluster import ClusterHandle, provision_cluster, stop_cluster
from tasks.model import prepare_base_model
from tasks.stage import Staged, StagedDict, cached_dataset, stage_dataset, stages_on_cluster


def stage_for(cfg: Config, model_path: str, on_cluster: bool) -> tuple[Staged, ClusterHandle | None]:
    """Stage where ``on_cluster`` says (``stages_on_cluster``, decided once by the caller): here, or on the cluster --
    provisioned for it only when source fingerprints do not already show the dataset staged. Returns the cluster it
    provisioned (the caller releases it), or None."""
    if not on_cluster:
        return stage_dataset(cfg, model_path), None
    if (found := cached_dataset(cfg, model_path)) is not None:
        return found, None
    handle = provision_cluster(cfg)
    try:
        return stage_dataset(cfg, model_path, handle), handle
    except BaseException:
        stop_cluster(cfg, handle, run=cfg.name)
        raise


@flow(name="stage-dataset")
def stage_flow(config_path: str | None = None, overrides: list[str] | None = None) -> StagedDict:
    """Stage ``data.train`` to ``<storage>/datasets/<id>``; returns the dataset id and manifest URL."""
    cfg = load_config(config_path, overrides or [])
    staged, handle = stage_for(cfg, prepare_base_model(cfg), stages_on_cluster(cfg))
    if handle is not None:
        stop_cluster(cfg, handle, run=cfg.name)
    return staged.to_dict()
