"""``train``: the optimization loop, its precision and parallelism, and the final export."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ray_jobs.config.base import Section
from ray_jobs.config.engines import EngineName
from ray_jobs.config.methods import MethodName


class RewardFunction(Section):
    function: str
    """``module:function``: the user's Python, importable where ``unbroken`` runs (the working directory is on the
    path) and shipped with the job to the workers. Called as TRL's reward functions are: ``f(prompts, completions,
    answer=..., **kwargs)`` with lists of strings (``answer``: each prompt's record completion, "" when it has none),
    returning one float (or None) per completion."""
    weight: float = 1.0
    """Its weight in the reward a completion is ranked by (the weighted sum of every function's)."""

    @field_validator("function")
    @classmethod
    def _dotted(cls, v: str) -> str:
        module, sep, name = v.partition(":")
        parts = module.split(".")
        if not sep or not name.isidentifier() or not all(p.isidentifier() for p in parts):
            raise ValueError(f"{v!r} is not module:function (e.g. configs.rewards.addition:correct)")
        return v  # (found where unbroken runs: control/check/probes.py rewards, before any cluster work)


def code_path(module: str) -> str:
    """Where ``module`` (dotted) is found, the working directory on the path: its top-level package's folder, or
    its file -- what a job ships so its workers import it by the same name. ValueError when it is nowhere."""
    import importlib.util
    import os
    import sys

    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script's path starts at its bin folder
        sys.path.append(os.getcwd())
    top = module.partition(".")[0]
    try:
        spec = importlib.util.find_spec(module) and importlib.util.find_spec(top)
    except ImportError as e:
        raise ValueError(f"cannot import {module}: {e}") from None
    if spec is None:
        raise ValueError(f"no module {module} (from {os.getcwd()} or the Python path)")
    if spec.submodule_search_locations:
        return str(list(spec.submodule_search_locations)[0])
    assert spec.origin is not None, top
    return spec.origin


class TrainConfig(Section):
    seed: int = 0
    """Seed for model init, data order and every RNG; same seed + same world size = same weights."""
    max_steps: int = Field(200, ge=1)
    """Optimizer steps to train for (or set ``epochs`` instead: one of the two)."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the training data, instead of ``max_steps``: every training row is trained on exactly this many
    times. The steps follow from the staged dataset (the data rank with the most rows sets them; the last step's
    rows past the final pass are masked from the loss), and the plan shows both."""
    micro_batch_size: int = Field(8, ge=1)
    """Packed sequences per worker per forward pass."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    lr: float = Field(3e-4, gt=0)
    """Peak AdamW learning rate."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Decay after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to ``lr``."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    eval_every_steps: int = Field(50, ge=1)
    """Run eval every N steps (and always at step 0 and at the end)."""
    evals_per_epoch: int | None = Field(None, ge=1)
    """Instead of ``eval_every_steps``: eval this many times per pass over the data (every round(steps per epoch /
    N) steps, the steps per epoch known once the data is staged; still at step 0 and at the end)."""
    eval_max_batches: int = Field(0, ge=0)
    """Cap on eval micro-batches per worker; 0 = the whole eval split."""
    log_every_steps: int = Field(10, ge=1)
    """Write a metrics.jsonl line every N steps."""
    sample_generations: int = Field(64, ge=0)
    """Held-out prompts the run's summary shows answered greedily by the base model and the fine-tuned one: rank 0 of
    the training job generates them after its export, from the staged eval split, one model at a time (bf16 on a GPU
    that has it, fp32 on a CPU), each answer at most its target's length + 8 tokens (256); 0 = none, as for a reward
    model (``train.method: reward`` scores answers, it does not generate). A failure there is a warning: the run has
    trained and exported."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: ``auto`` = bf16 autocast on GPU, fp32 on CPU. Weights and optimizer moments are always fp32
    (the base model is loaded in fp32 whatever dtype it was saved in)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    compile: bool = False
    """``torch.compile`` the model (in place: checkpoints keep their keys). Faster steps on a GPU after a compile of
    a minute or so at the start of every worker; numerics differ from eager, so resume a run with the setting it was
    started with for bit-identical weights."""
    deterministic: bool = True
    """Deterministic kernels (on GPU also ``CUBLAS_WORKSPACE_CONFIG``): a killed and resumed run ends bit-identical
    to an uninterrupted one. false = fastest kernels; resume then restores the same data order and state, but the
    weights are not bit-identical."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the final export; ``auto`` = the base model's own dtype (training always keeps fp32 weights)."""
    export: Literal["merged", "adapter"] = "merged"
    """What ``runs/<run>/final`` holds: ``merged``, a plain HF model (LoRA merged into the weights); ``adapter``
    (LoRA runs), the PEFT adapter folder alone (``adapter_config.json``, ``adapter_model.safetensors``, the
    tokenizer) for multi-LoRA serving -- loaded with ``PeftModel.from_pretrained(base, folder)``."""
    export_shard_mb: float = Field(5000.0, gt=0)
    """Largest safetensors file of the final export, in MB; a bigger model is split across files with an index
    (``save_pretrained``'s ``max_shard_size``)."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """``ddp`` replicates the model on every worker; ``fsdp`` shards it (FSDP2) for models too big for one device."""
    engine: EngineName = "native"
    """Who runs each step: ``native``, unbroken's own loop; ``hf``, Hugging Face ``transformers.Trainer`` (its
    forward, loss and backward, its options through ``train.hf_args``) inside the same job -- unbroken still feeds the
    data from its cursor, owns the optimizer, the schedule, the checkpoints, the heartbeat and the metrics, so a
    killed ``hf`` run resumes exactly as a native one does."""
    method: MethodName = "auto"
    """What the run optimizes (``ray_jobs/config/methods.py``): ``sft``, next-token cross-entropy on the completions;
    ``trl_sft``, the same through TRL's ``SFTTrainer`` (its token accuracy logged); ``dpo`` on preference pairs;
    ``kto`` on completions labelled desirable or not (``data.format: unpaired_preference``); ``reward``, a reward
    model (a scalar head) on preference pairs; ``grpo``, completions sampled for each prompt and scored by
    ``train.rewards``. ``auto``: ``dpo`` for preference pairs, else ``sft``. All but ``sft`` need ``engine: hf``
    (TRL's trainer computes each step; unbroken feeds, checkpoints and resumes it)."""
    rewards: list[RewardFunction] = Field(default_factory=list)
    """``method: grpo``: the functions scoring each sampled completion, e.g. ``[{function:
    configs.rewards.addition:correct}, {function: configs.rewards.addition:digits_only, weight: 0.1}]``. One that
    raises or returns the wrong number of rewards fails the run as a user error naming it, the step and the
    example."""
    hf_args: dict[str, Any] = Field(default_factory=dict)
    """With ``engine: hf``: any other ``transformers.TrainingArguments`` field by its name (e.g.
    ``label_smoothing_factor``, ``neftune_noise_alpha``), checked against the installed transformers when the config
    is loaded; the fields unbroken sets from its own config (learning rate, batch sizes, steps, precision, saving,
    logging, seed) are refused naming the field to set instead."""
