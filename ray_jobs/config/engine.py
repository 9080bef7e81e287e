"""``train.engine``: what the ``hf`` engine can run, and ``train.hf_args`` checked against the installed
``transformers.TrainingArguments`` (names and value types), before any cluster work."""

from __future__ import annotations

import difflib
import functools
from typing import Any

# TrainingArguments fields unbroken sets itself (ray_jobs/train/hf.py): the config field a user sets instead.
OWNED = {
    "output_dir": "storage", "max_steps": "train.max_steps", "num_train_epochs": "train.max_steps",
    "per_device_train_batch_size": "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum_steps",
    "learning_rate": "train.lr", "lr_scheduler_type": "train.lr_schedule", "warmup_steps": "train.warmup_steps",
    "warmup_ratio": "train.warmup_steps", "weight_decay": "train.weight_decay", "max_grad_norm": "train.max_grad_norm",
    "optim": "train.lr (unbroken's AdamW)", "seed": "train.seed", "data_seed": "train.seed",
    "bf16": "train.precision", "fp16": "train.precision", "use_cpu": "cluster.use_gpu",
    "gradient_checkpointing": "train.gradient_checkpointing", "torch_compile": "train.compile",
    "save_strategy": "checkpoint.every_steps", "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep", "eval_strategy": "train.eval_every_steps",
    "eval_steps": "train.eval_every_steps", "logging_strategy": "train.log_every_steps",
    "logging_steps": "train.log_every_steps", "report_to": "tracking", "resume_from_checkpoint": "a run's --resume",
    "ignore_data_skip": "nothing (unbroken's cursor resumes the data)", "fsdp": "train.parallelism",
    "deepspeed": "nothing yet (DeepSpeed under the hf engine is not built)",
    "per_device_eval_batch_size": "train.micro_batch_size", "dataloader_num_workers": "nothing (rows come from "
    "the node cache)", "remove_unused_columns": "nothing (unbroken's rows are already model inputs)",
}  # fmt: skip


@functools.cache
def _fields() -> dict[str, Any]:
    import dataclasses
    import typing

    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


def hf_args_problems(hf_args: dict[str, Any]) -> list[str]:
    """One line per ``train.hf_args`` entry that is not a TrainingArguments field, is unbroken's to set, or whose
    value does not fit the field's type."""
    from pydantic import TypeAdapter, ValidationError

    if not hf_args:
        return []
    fields, problems = _fields(), []
    for name, value in hf_args.items():
        where = f"train.hf_args.{name}"
        if name in OWNED:
            problems.append(f"{where}: unbroken sets this from its own config; set {OWNED[name]} instead")
        elif name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{where}: not a field of transformers.TrainingArguments{hint}")
        else:
            try:
                TypeAdapter(fields[name]).validate_python(value)
            except ValidationError as e:
                problems.append(f"{where}: {e.errors()[0]['msg']} (got {value!r})")
    return problems


def engine_problems(cfg: Any) -> list[str]:
    """Why the config's engine cannot run it: the ``hf`` engine steps with HF's DDP (accelerate), one replica per
    worker, so FSDP and live recovery (the native loop's) are refused by name."""
    t = cfg.train
    if t.engine != "hf":
        return ["train.hf_args: only read with train.engine=hf"] if t.hf_args else []
    problems = []
    if t.parallelism == "fsdp":
        problems.append("train.engine: hf runs DDP only (train.parallelism=fsdp needs the native engine)")
    if cfg.fault_tolerance.live_recovery:
        problems.append("train.engine: hf cannot run fault_tolerance.live_recovery (the native loop's replicas)")
    return problems + hf_args_problems(t.hf_args)
