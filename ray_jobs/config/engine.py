"""``train.engine``: what a config asks of its engine checked against the engine's row (``ENGINES``,
``ray_jobs/config/engines.py``), and ``train.hf_args`` checked against the installed ``transformers.TrainingArguments``
(names and value types), before any cluster work."""

from __future__ import annotations

import difflib
import functools
from typing import Any

from ray_jobs.config.engines import ENGINES, Engine, engine_of, needs
from ray_jobs.config.methods import METHODS, load_class, method_of, method_problems
from ray_jobs.config.record_formats import record_format

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
    "fsdp_config": "train.parallelism (unbroken's FSDP2 shards the model)",
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
    "steps_per_generation": "train.grad_accum_steps (completions are sampled once per optimizer step)",
    "generation_batch_size": "train.micro_batch_size (prompts per micro-batch, each sampled num_generations times)",
    "num_iterations": "nothing (one optimizer step per sampling: a checkpoint between steps holds no buffered "
                      "completions)",
    "shuffle_dataset": "nothing (unbroken's cursor orders the prompts)",
    "reward_weights": "train.rewards (each function's weight)",
    "use_vllm": "nothing (not yet: completions are sampled in the training worker)",
    "dataset_text_field": "nothing (rows come staged)", "packing": "data.packing",
}  # fmt: skip


@functools.cache
def _fields(args: str) -> dict[str, Any]:  # field name -> its type hint (what TypeAdapter takes: typing says Any)
    import dataclasses
    import typing

    TrainingArguments = load_class(args)  # noqa: N806 -- a class
    hints = typing.get_type_hints(TrainingArguments)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


def hf_args_problems(hf_args: dict[str, Any], args: str = "transformers:TrainingArguments") -> list[str]:
    """One line per ``train.hf_args`` entry that is not a field of ``args`` (the method's arguments class:
    ``trl:DPOConfig``...), is unbroken's to set, or whose value does not fit the field's type."""
    from pydantic import TypeAdapter, ValidationError

    if not hf_args:
        return []
    fields, problems = _fields(args), []
    what = args.replace(":", ".")
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


# The refusal a config gets when it asks for what its engine lacks (an engine's row may say more: its
# ``refusals``). {engine}: the engine's name; {field}: what chooses it; {by}: that choice as set; {needs}: how to
# choose one that can.
REFUSALS = {
    "preference": "data.format: preference records are trained by DPO (TRL's DPOTrainer), which needs {needs}",
    "hf_args": "train.hf_args: only read with {needs}",
    "fsdp": "{field}: {engine} runs DDP only (train.parallelism=fsdp needs {needs})",
    "live_recovery": "{field}: {engine} cannot run fault_tolerance.live_recovery (its replicas run the steps of "
    "{needs})",
    "standbys": "fault_tolerance.standby_replicas: needs {needs} (a standby is a live replica that steps with the "
    "others)",
    "lora": "model.lora: {by} trains no LoRA adapters (they need {needs})",
    "quantization": "model.quantization: 4bit is not supported with {by} (it needs {needs})",
    "local_mode": "{field}: {by} needs Ray Train; local mode runs a fixed set of processes (use `unbroken run`)",
}


def asked(cfg: Any) -> dict[str, bool]:
    """Each capability of an engine (``Engine``'s fields) and whether ``cfg`` asks for it (``live_recovery``: by
    turning its switch on, :func:`capability_problems`)."""
    t, ft = cfg.train, cfg.fault_tolerance
    return {
        "preference": record_format(cfg.data.format).pairs,
        "hf_args": bool(t.hf_args),
        "fsdp": t.parallelism == "fsdp",
        "standbys": ft.standby_replicas > 0,
        "lora": cfg.model.lora is not None,
        "quantization": cfg.model.quantization != "none",
    }


def refusal(engine: Engine, capability: str) -> str:
    """What a config asking ``engine`` for ``capability``, which it lacks, is told (naming the field)."""
    text = engine.refusals.get(capability) or REFUSALS[capability]
    return text.format(engine=engine.name, field=engine.chooser, by=engine.chosen_by, needs=needs(capability))


def capability_problems(cfg: Any) -> list[str]:
    """What ``cfg`` asks of its engine that the engine's row (``ENGINES``) says it cannot do. An engine a switch
    turns on (live recovery) runs the steps of the one ``train.engine`` chooses: when that one cannot run under it,
    that is refused, and the rest is asked of the chosen one."""
    chosen, running = ENGINES[cfg.train.engine], engine_of(cfg)
    problems = []
    if running is not chosen and not chosen.live_recovery:
        problems.append(refusal(chosen, "live_recovery"))
        running = chosen
    wanted = [c for c, asks in asked(cfg).items() if asks and not getattr(running, c)]
    return problems + [refusal(running, c) for c in wanted]


def engine_problems(cfg: Any) -> list[str]:
    """Why the config's engine cannot run it: what it asks for that its engine lacks (:func:`capability_problems`),
    what a preference pair or an adapter export cannot take, a 4-bit base's needs, and ``train.hf_args`` checked
    against HF's arguments when the engine reads them."""
    t, problems = cfg.train, capability_problems(cfg) + method_problems(cfg)
    fmt, engine = record_format(cfg.data.format), ENGINES[t.engine]
    if fmt.pairs and cfg.data.too_long == "truncate":
        problems.append("data.too_long: truncate cannot cut a preference pair; use reject or drop")
    if t.export == "adapter" and cfg.model.lora is None:
        problems.append("train.export: adapter exports LoRA adapters; set model.lora (or train.export=merged)")
    if cfg.model.quantization != "none":
        problems += [f"model.quantization: {p}" for p in quantization_problems(cfg)]
    if not (engine.hf_args and t.hf_args):
        return problems
    if t.hf_args.get("use_liger_kernel") and (p := liger_problem(cfg.cluster.use_gpu, cfg.cluster.backend_name)):
        problems.append(f"train.hf_args.use_liger_kernel: {p}")
    return problems + hf_args_problems(t.hf_args, hf_args_class(t.method, fmt))


def hf_args_class(method: str, fmt: Any) -> str:
    """The arguments class ``train.hf_args`` is checked against: the method's; ``auto`` on records ``auto`` may
    detect as preference pairs, DPOConfig (TrainingArguments' fields and DPO's)."""
    if method == "auto" and fmt.detected:
        return METHODS["dpo"].args
    return method_of(method, fmt.pairs).args


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
    train on it; the workers need ``bitsandbytes``. (Which engines train on one: ``Engine.quantization``.)"""
    problems = []
    if cfg.model.lora is None:
        problems.append(
            "4bit keeps the base model frozen in 4-bit: only LoRA adapters train on it (QLoRA); "
            "set model.lora (or model.quantization=none)"
        )
    if missing_here(cfg.cluster.backend_name, "bitsandbytes"):
        problems.append("4bit needs the bitsandbytes package: pip install 'unbroken[qlora]'")
    return problems
