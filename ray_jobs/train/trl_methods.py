"""Each ``train.method``'s part of the ``hf`` engine (``hf.py``): the TRL trainer it subclasses, what that trainer
needs at construction beyond HF's arguments, its arguments' method-specific fields, and its metrics as metrics-log
columns -- read from the method's row (``ray_jobs/config/methods.py``).

- ``dpo``: TRL's DPOTrainer; the reference is the base model -- the adapters disabled under LoRA, else a frozen copy
  loaded from the same folder; eval is DPO's loss on the held-out pairs (:func:`method_eval`).
- ``kto``: TRL's KTOTrainer on unpaired completions, its reference the base as DPO's; each micro-batch's KL sequences
  are its own prompts with its completions rotated by one (``ray_jobs/data/unpaired.py``), cut to KTOConfig's
  ``max_length`` (by default twice ``data.seq_len``: never cut); eval is KTO's loss on the held-out completions.
- ``reward``: TRL's RewardTrainer training a scalar head on the base (``ray_jobs/model/loading.py``) over preference
  pairs; eval is its loss on the held-out pairs, its accuracy beside it.
- ``grpo``: TRL's GRPOTrainer sampling from the staged prompts (``grpo.py``).
- ``trl_sft``: TRL's SFTTrainer on unbroken's packed rows.

Every method but GRPO is fed a micro-batch at a time from the cursor's rows (:func:`micro_batch_inputs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from ray_jobs.config.methods import Method, column_of, load_class

GENERATIONS = 8  # GRPOConfig's default num_generations (completions sampled per prompt)

# The one example a TRL trainer is built with (it insists on a dataset and prepares it at construction, while the rows
# it trains come staged through ``get_train_dataloader``), in the records its method reads
PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "trl_sft": {"text": "a"},
    "dpo": {"prompt": "a", "chosen": " b", "rejected": " c"},
    "kto": {"prompt": "a", "completion": " b", "label": True},
    "reward": {"prompt": "a", "chosen": " b", "rejected": " c"},
    "grpo": {"prompt": "a"},
}


def trainer_class(owner) -> Any:
    """The class whose steps the engine subclasses: the method's trainer (GRPO's sampling from staged prompts)."""
    base = load_class(owner.method.trainer)
    if owner.method.name == "grpo":
        from ray_jobs.train.grpo import staged_prompts

        return staged_prompts(base, owner)
    return base


def generations(owner) -> int:
    """GRPO's completions sampled per prompt (``train.hf_args.num_generations``, else TRL's default)."""
    return int(owner.cfg.train.hf_args.get("num_generations", GENERATIONS))


def construction(owner) -> dict[str, Any]:
    """What the method's trainer takes at construction beyond HF's Trainer's arguments."""
    name = owner.method.name
    if name not in PLACEHOLDERS:
        return {}
    out = _tokenizer_and_placeholder(owner, PLACEHOLDERS[name])
    if owner.method.rewards:
        from ray_jobs.train.grpo import reward_functions

        out["reward_funcs"] = reward_functions(owner)
    if owner.method.reference and not owner.lora:  # under LoRA, none: the adapters disabled (after_construction)
        out["ref_model"] = frozen_base(owner)
    return out


def method_args(owner) -> dict[str, Any]:
    """The method's arguments fields that follow from unbroken's config (GRPO's batch shape, KTO's max_length)."""
    if owner.method.name == "grpo":
        from ray_jobs.train.grpo import grpo_args

        return grpo_args(owner, generations(owner))
    if owner.method.name == "trl_sft":
        return {"dataset_text_field": "text", "packing": False}
    if owner.method.name == "kto":  # a KL sequence (a prompt + another row's completion) is up to twice a row
        return {"max_length": 2 * owner.manifest.seq_len}
    return {}


def after_construction(engine, owner) -> None:
    """What the method's trainer set up that unbroken undoes: under LoRA, TRL's frozen copy of the adapters as the
    reference (made after a resume it would be the trained adapters) -- without it the adapters are disabled for the
    reference: the base model, whatever the step."""
    if owner.method.reference and owner.lora:
        model = engine.accelerator.unwrap_model(engine.model)
        if "ref" in model.peft_config:
            model.delete_adapter("ref")
            model.set_adapter("default")


def columns(method: Method, metrics: dict[str, list[float]]) -> dict[str, float]:
    """The trainer's metrics (per micro-batch or per sampling, already averaged over the ranks) as metrics-log
    columns, each the mean of its values."""
    out = {}
    for key, values in metrics.items():
        if (column := column_of(method, key)) is not None and values:
            out[column] = sum(values) / len(values)
    return out


def _tokenizer_and_placeholder(owner, example: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer (the node's copy) and a dataset of one placeholder example (:data:`PLACEHOLDERS`)."""
    from datasets import Dataset

    from ray_jobs.model.loading import load_tokenizer

    return {
        "processing_class": load_tokenizer(owner.model_path, owner.cfg.data.cache_dir),
        "train_dataset": Dataset.from_list([example]),
    }


def frozen_base(owner):
    """The reference of a full fine-tune (DPO's, KTO's): a frozen copy of the base loaded from its folder -- never
    the policy's weights, which a resumed run has trained (TRL would load its copy from the model's config)."""
    from ray_jobs.model.loading import load_model_fp32

    ref = load_model_fp32(owner.model_path, owner.cfg.data.cache_dir).to(owner.device).eval()
    return ref.requires_grad_(False)


def batch_of(owner, rows: tuple, keep=None) -> dict[str, Any]:
    """Staged rows (the three row parts) as the method's TRL trainer's collator builds its batch: DPO's pairs, KTO's
    labelled completions with their KL sequences, a reward model's pairs. ``keep``: the rows that count (None:
    all; one past ``train.epochs``' last pass moves nothing)."""
    from ray_jobs.data.preference import pair_batch, reward_batch
    from ray_jobs.data.unpaired import kto_batch

    name = owner.method.name
    if name == "kto":  # cut as KTOConfig's max_length cuts (train.hf_args may set it)
        return kto_batch(*rows, owner.pad_id, keep=keep, max_length=owner.engine().args.max_length)
    return (reward_batch if name == "reward" else pair_batch)(*rows, owner.pad_id, keep=keep)


def micro_batch_inputs(owner, mb) -> dict[str, Any]:
    """One micro-batch of the cursor's rows (a ``MicroBatch``) as the method's trainer takes it, its tokens counted
    in the step: packed rows (a row past the last pass with its labels masked), else :func:`batch_of` -- the tokens
    of the sequences that count (a pair's both, not KTO's KL sequences: those move nothing)."""
    import numpy as np
    import torch

    if owner.method.records == "rows":
        ids, labels, pos = (torch.from_numpy(a) for a in mb.arrays)
        owner.count_tokens(mb.tokens)
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "use_cache": False}
    batch = batch_of(owner, mb.rows, mb.keep)
    mask = batch["attention_mask"]
    owner.count_tokens(int(mask[np.tile(mb.keep, len(mask) // len(mb.keep))].sum()))  # pairs: chosen, then rejected
    return batch


def method_eval(owner, rows) -> tuple[float, dict[str, float]]:
    """The method's mean loss over the held-out ``rows`` (DPO's, KTO's, a reward model's: each rank its slice, every
    rank as many batches -- TRL gathers inside), and its eval metric (``Method.eval_metric``) as ``eval_<column>``."""
    loss, metrics = trl_eval(owner, rows)
    column = owner.method.eval_metric
    value = columns(owner.method, metrics).get(column)
    return loss, {} if value is None else {f"eval_{column}": value}


def trl_eval(owner, rows) -> tuple[float, dict[str, list[float]]]:
    """The TRL trainer's mean loss over ``rows`` (batches of :func:`batch_of`, ``train.micro_batch_size`` records
    each, a KTO batch's KL sequences from its own records) and its eval metrics of it."""
    import numpy as np
    import torch

    from ray_jobs.train.eval import eval_batches

    engine, rt, t = owner.engine(), owner.rt, owner.cfg.train
    # TRL gathers per-record tensors across ranks (no padding): every rank's batches must be the same size, so each
    # takes an equal slice and the last len(rows) % world_size records are left out (none at one worker)
    usable = len(rows) - len(rows) % rt.world_size
    mine, mb = np.arange(rt.rank, usable, rt.world_size), t.micro_batch_size
    engine.model_wrapped.eval()
    engine._metrics["eval"].clear()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(eval_batches(usable, rt.world_size, mb, t.eval_max_batches)):
            idx = mine[b * mb : b * mb + mb]
            batch = engine._prepare_inputs(batch_of(owner, rows.take(idx)))
            loss = float(engine.compute_loss(engine.model_wrapped, batch))
            total, count = total + loss * len(idx), count + len(idx)
    total, count = rt.all_reduce_sum([total, float(count)])
    metrics = {k: list(v) for k, v in engine._metrics["eval"].items()}
    engine._metrics["eval"].clear()
    return total / max(count, 1.0), metrics


@contextlib.contextmanager
def quiet_datasets() -> Generator[None]:
    """``datasets``' progress bars off (a TRL trainer maps its one placeholder example at construction: five bars in
    the job's log for nothing), as they were after."""
    from datasets.utils import logging as datasets_logging

    was = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            datasets_logging.enable_progress_bar()
