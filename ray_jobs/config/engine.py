"""``train.engine``: what the ``hf`` engine can run, and ``train.hf_args`` checked against the installed
``transformers.TrainingArguments`` (names and value types), before any cluster work."""

from __future__ import annotations

import difflib
import functools
from typing import Any

# TrainingArguments fields unbroken sets itself (ray_jobs/train/hf.py): the config field a user sets instead.
OWNED = {
    "output_dir": "storage", "max_steps": "train.max_steps", "num_train_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum_steps",
    "learning_rate": "train.lr", "lr_scheduler_type": "train.lr_schedule", "warmup_steps": "train.warmup_steps",
    "warmup_ratio": "train.warmup_steps", "weight_decay": "train.weight_decay", "max_grad_norm": "train.max_grad_norm",
    "optim": "train.lr (unbroken's AdamW)", "seed": "train.seed", "data_seed": "train.seed",
    "bf16": "train.precision", "fp16": "train.precision", "use_cpu": "cluster.use_gpu",
    "gradient_checkpointing": "train.gradient_checkpointing", "torch_compile": "train.compile",
    "save_strategy": "checkpoint.every_steps", "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.num_to_keep", "eval_strategy": "train.eval_every_steps",
    "eval_steps": "train.eval_every_steps", "logging_strategy": "train.log_every_steps",
    "logging_steps": "train.log_every_steps", "report_to": "tracking",
    "resume_from_checkpoint": "nothing (a run resumes from its newest valid checkpoint by itself)",
    "ignore_data_skip": "nothing (unbroken's cursor resumes the data)", "fsdp": "train.parallelism",
    "deepspeed": "nothing (not yet: DeepSpeed owns the optimizer and writes checkpoints of its own, which "
                 "unbroken's sealed checkpoints and exact resume do not cover)",
    "adam_beta1": "nothing (unbroken's AdamW)", "adam_beta2": "nothing (unbroken's AdamW)",
    "adam_epsilon": "nothing (unbroken's AdamW)", "optim_args": "nothing (unbroken's AdamW)",
    "optim_target_modules": "nothing (unbroken's AdamW)", "lr_scheduler_kwargs": "train.lr_schedule",
    "sync_ref_model": "nothing (the reference stays the base model: unbroken's checkpoints do not hold another)",
    "ref_model_mixup_alpha": "nothing (the reference stays the base model)",
    "ref_model_sync_steps": "nothing (the reference stays the base model)",
    "per_device_eval_batch_size": "train.micro_batch_size", "max_length": "data.seq_len",
    "precompute_ref_log_probs": "nothing (the reference log-probs are computed with each batch)",
    "padding_free": "nothing (rows come staged)", "truncation_mode": "data.too_long",
    "dataloader_num_workers": "nothing (rows come from the node cache)",
    "remove_unused_columns": "nothing (unbroken's rows are already model inputs)",
}  # fmt: skip


@functools.cache
def _fields(dpo: bool) -> dict[str, Any]:  # field name -> its type hint (what TypeAdapter takes: typing says Any)
    import dataclasses
    import typing

    if dpo:
        from trl import DPOConfig as TrainingArguments
    else:
        from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


def hf_args_problems(hf_args: dict[str, Any], dpo: bool = False) -> list[str]:
    """One line per ``train.hf_args`` entry that is not a field of TrainingArguments (``dpo``: TRL's DPOConfig), is
    unbroken's to set, or whose value does not fit the field's type."""
    from pydantic import TypeAdapter, ValidationError

    if not hf_args:
        return []
    fields, problems = _fields(dpo), []
    what = "trl.DPOConfig" if dpo else "transformers.TrainingArguments"
    for name, value in hf_args.items():
        where = f"train.hf_args.{name}"
        if name in OWNED and OWNED[name].startswith("nothing"):
            problems.append(f"{where}: not passed to HF {OWNED[name].removeprefix('nothing ')}")
        elif name in OWNED:
            problems.append(f"{where}: unbroken sets this from its own config; set {OWNED[name]} instead")
        elif name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{where}: not a field of {what}{hint}")
        else:
            try:
                TypeAdapter(fields[name]).validate_python(value, strict=True)  # passed to HF as written
            except ValidationError as e:
                problems.append(f"{where}: {e.errors()[0]['msg']} (got {value!r})")
    return problems


def engine_problems(cfg: Any) -> list[str]:
    """Why the config's engine cannot run it: the ``hf`` engine steps with HF's DDP (accelerate), one replica per
    worker, so FSDP and live recovery (the native loop's) are refused by name."""
    t, problems = cfg.train, []
    if cfg.data.format == "preference":
        if t.engine != "hf":
            problems.append(
                "data.format: preference records are trained by DPO (TRL's DPOTrainer), which needs train.engine=hf"
            )
        if cfg.data.too_long == "truncate":
            problems.append("data.too_long: truncate cannot cut a preference pair; use reject or drop")
    if t.export == "adapter" and cfg.model.lora is None:
        problems.append("train.export: adapter exports LoRA adapters; set model.lora (or train.export=merged)")
    if cfg.model.quantization != "none":
        problems += [f"model.quantization: {p}" for p in quantization_problems(cfg)]
    if t.engine != "hf":
        return problems + (["train.hf_args: only read with train.engine=hf"] if t.hf_args else [])
    if t.hf_args.get("use_liger_kernel") and (p := liger_problem(cfg.cluster.use_gpu, cfg.cluster.backend_name)):
        problems.append(f"train.hf_args.use_liger_kernel: {p}")
    if t.parallelism == "fsdp":
        problems.append("train.engine: hf runs DDP only (train.parallelism=fsdp needs the native engine)")
    if cfg.fault_tolerance.live_recovery:
        problems.append("train.engine: hf cannot run fault_tolerance.live_recovery (the native loop's replicas)")
    # auto may detect preference records: their DPOConfig (TrainingArguments' fields and DPO's) is checked then
    return problems + hf_args_problems(t.hf_args, dpo=cfg.data.format in ("preference", "auto"))


def missing_here(backend: str, module: str) -> bool:
    """Whether the workers lack ``module``, as far as it is known here: only for a local head, whose workers run in
    this machine's environment. A remote cluster's workers name a missing package themselves when they import it
    (HF's and transformers' ImportError names it)."""
    import importlib.util

    return backend == "local" and importlib.util.find_spec(module) is None


def liger_problem(use_gpu: bool, backend: str) -> str | None:
    """Why Liger's kernels (HF Trainer's ``use_liger_kernel``, which patches the model with them) cannot run: they
    are Triton kernels, for CUDA devices, from the ``liger-kernel`` package (``pip install 'unbroken[gpu]'``)."""
    if not use_gpu:
        return "Liger's kernels are Triton kernels and need a CUDA device; set cluster.use_gpu=true"
    if missing_here(backend, "liger_kernel"):
        return "needs the liger-kernel package: pip install 'unbroken[gpu]'"
    return None


def quantization_problems(cfg: Any) -> list[str]:
    """Why ``model.quantization: 4bit`` (QLoRA) cannot run this config: a 4-bit base is frozen, so only LoRA adapters
    train on it; live recovery heals a replica from its peer's state, which has not been shown to hold for a 4-bit
    base; the workers need ``bitsandbytes``."""
    problems = []
    if cfg.model.lora is None:
        problems.append(
            "4bit keeps the base model frozen in 4-bit: only LoRA adapters train on it (QLoRA); "
            "set model.lora (or model.quantization=none)"
        )
    if cfg.fault_tolerance.live_recovery:
        problems.append(
            "4bit is not supported with fault_tolerance.live_recovery yet (a replica is healed from its "
            "peer's state; not shown for a 4-bit base): the watchdog and Ray Train's restarts cover it"
        )
    if missing_here(cfg.cluster.backend_name, "bitsandbytes"):
        problems.append("4bit needs the bitsandbytes package: pip install 'unbroken[qlora]'")
    return problems
