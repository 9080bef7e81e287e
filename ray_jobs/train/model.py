"""The model a worker trains: the base model loaded, optionally LoRA-wrapped, then DDP-prepared or FSDP-sharded;
and the model rank 0 exports at the end."""

from __future__ import annotations

from typing import Any

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config
from ray_jobs.model.loading import config_dict, load_model_fp32, saved_dtype
from ray_jobs.model.lora import check_lora, ties_embeddings
from ray_jobs.train.runtime import Runtime


def build_model(cfg: Config, model_path: str, rt: Runtime):
    model = load_model_fp32(model_path, cfg.data.cache_dir)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    if cfg.train.parallelism == "fsdp":
        return rt.shard_model(model)
    return rt.prepare_model(model.to(rt.device()))


def apply_lora(model, cfg: Config):
    """Wrap ``model`` in peft LoRA adapters; a config that does not fit the model is a ValueError naming the field
    (the flow checks this before any cluster work; this catches a job submitted without it)."""
    from peft import LoraConfig, get_peft_model

    lc = cfg.model.lora
    check_lora(model, lc, cfg.model.name_or_path)
    targets = lc.target_modules if isinstance(lc.target_modules, str) else list(lc.target_modules)
    return get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=targets,
            modules_to_save=list(lc.modules_to_save) or None,  # a copy: peft edits this list in place
            ensure_weight_tying=_needs_tying(model, lc.modules_to_save),
            task_type="CAUSAL_LM",
        ),
    )


def _needs_tying(model, modules_to_save: list[str]) -> bool:
    """Whether peft must keep a tied head tied: without ``ensure_weight_tying``, peft 0.21 trains a separate copy
    of a tied ``lm_head`` listed in modules_to_save, and the merged export silently comes out untied
    (``tie_word_embeddings=False``, a second vocab x hidden matrix). (Adapters on a tied layer are refused by
    :func:`check_lora`.) Asked only when needed: peft warns when it finds nothing to tie."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    return ties_embeddings(model) and any(n.rsplit(".", 1)[-1] in EMBEDDING_LAYER_NAMES for n in modules_to_save)


def export_model(cfg: Config, model_path: str, state: dict[str, Any]):
    """The final model as a plain HF model in ``train.export_dtype``: the base model with the trained weights
    (LoRA merged in), tied embeddings still tied."""
    import torch

    model = load_model_fp32(model_path, cfg.data.cache_dir)
    tied = ties_embeddings(model)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
        ckpt.load_model_state(model, state, fsdp=False, trainable_only=True)
        model = model.merge_and_unload()
    else:
        ckpt.load_model_state(model, state, fsdp=False, trainable_only=False)
    if tied and not ties_embeddings(model):
        raise RuntimeError("the merged model lost its tied input/output embeddings; refusing to export it untied")
    return model.to(getattr(torch, export_dtype(cfg, model_path)))


def export_dtype(cfg: Config, model_path: str) -> str:
    """``train.export_dtype``, with ``auto`` resolved to the dtype the base model was saved in."""
    if cfg.train.export_dtype != "auto":
        return cfg.train.export_dtype
    return saved_dtype(config_dict(model_path))
