"""The model a worker trains: the base model loaded, optionally LoRA-wrapped, then DDP-prepared or FSDP-sharded."""

from __future__ import annotations

from ray_jobs.config import Config
from ray_jobs.model.loading import load_model
from ray_jobs.train.runtime import Runtime


def build_model(cfg: Config, model_path: str, rt: Runtime):
    model = load_model(model_path, cfg.data.cache_dir)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    if cfg.train.parallelism == "fsdp":
        return rt.shard_model(model)
    return rt.prepare_model(model.to(rt.device()))


def apply_lora(model, cfg: Config):
    from peft import LoraConfig, get_peft_model

    lc = cfg.model.lora
    return get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=lc.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
