"""The ``hf`` engine (``train.engine: hf``): Hugging Face ``transformers.Trainer`` runs each step -- its forward, its
loss (``compute_loss``, with whatever ``train.hf_args`` switch on: label smoothing, NEFTune, ...), its backward
through accelerate's DDP, gradient clipping and the optimizer step -- inside the same job as the native loop.

What unbroken keeps, and why by hand: HF resumes data by iterating past consumed batches and restores RNG per rank
from its own checkpoint folders, which neither knows unbroken's staged rows nor seals a checkpoint with a manifest.
So :class:`HfTrainer` is the native :class:`~ray_jobs.train.trainer.Trainer` with its step handed to HF:

- the rows come from unbroken's cursor (:class:`Batches`: this worker's micro-batches of every step, the packed
  rows, labels and position ids the native loop trains on), so a resumed run reads exactly the rows it would have;
- the optimizer and LR schedule are unbroken's (``Trainer(optimizers=...)``), the very objects its checkpoints hold;
- after every optimizer step HF calls back (:class:`Hooks`), and the native step's end runs: one agreed all-reduce
  of loss/tokens/flags, the metrics row (HF's ``report_to`` is off: unbroken's log feeds the trackers once), eval,
  the checkpointer (async, sealed by its manifest, reported to Ray Train), SIGTERM and drain notices;
- resume is the native resume (newest valid checkpoint, a torn one skipped) before HF starts, which then trains the
  steps left; its ``set_seed`` at construction is undone (the RNG a checkpoint restored is put back).

Preference records (``data.format: preference``, :mod:`ray_jobs.data.preference`) are trained by TRL's
``DPOTrainer`` the same way: its loss (``beta``, ``loss_type``... through ``train.hf_args``, checked against
``DPOConfig``) on unbroken's rows; the reference is the base model -- the adapters disabled under LoRA, else a frozen
copy loaded from the same folder; its reward accuracy and margin go to the metrics log (``reward_accuracy``,
``reward_margin``; ``eval_reward_accuracy`` on eval steps), and eval is DPO's loss on the held-out pairs.
"""

from __future__ import annotations

import time
from typing import Any

from ray_jobs import faults
from ray_jobs.checkpoint.rng import rng_state, set_rng_state
from ray_jobs.config.record_formats import staged_format
from ray_jobs.contracts.metrics import MetricsRow
from ray_jobs.train import model as models
from ray_jobs.train.model import Placement
from ray_jobs.train.trainer import Agreed, Trainer


class _Unwrapped:
    """The runtime as the model builder sees it (its :class:`~ray_jobs.train.model.Placement`) under the hf engine:
    accelerate, inside HF's Trainer, wraps the model in DDP; a model Ray Train had wrapped already would be wrapped
    twice."""

    def __init__(self, rt: Placement):
        self.rt = rt

    def prepare_model(self, model):
        return model

    def device(self):
        return self.rt.device()

    def shard_model(self, model):
        return self.rt.shard_model(model)


class HfTrainer(Trainer):
    """The native trainer whose steps HF's ``Trainer`` computes (module docstring)."""

    def build_model(self):
        self.preference = staged_format(self.manifest.format).pairs
        self._engine, self._window, self._eval_extra = None, {}, {}
        return models.build_model(self.cfg, self.model_path, _Unwrapped(self.rt))

    def engine(self):
        """HF's (or TRL's) trainer, built once, after the resume (so it trains the steps left)."""
        if self._engine is None:
            rng = rng_state()  # HF's Trainer seeds every RNG as it is built: a resumed run's state comes back after
            self._engine = hf_trainer(self, self.cfg.train.max_steps - self.loop.step)
            set_rng_state(rng)
        return self._engine

    def train_to(self, end: int) -> None:
        if self.loop.step >= end:
            return
        self._step_loss, self._step_tokens, self._grad_norm = 0.0, 0, 0.0
        self._step_started = time.monotonic()
        self.stop_at = end
        self.engine().train()

    def hf_step_end(self) -> bool:
        """After HF's optimizer step: the native step's end (agree, advance, log, eval, checkpoint, preemption);
        True when training should stop here."""
        if self.preference:  # TRL's per-micro-batch numbers, kept until the next logged row (not in TRL's own lists)
            assert self._engine is not None, "HF calls back from inside engine().train()"
            for key, values in self._engine._metrics["train"].items():
                self._window.setdefault(key, []).extend(values)
            self._engine._metrics["train"].clear()
        agreed = self.agreed(self._step_loss, self._step_tokens, self._grad_norm)
        self.cursors = self.plan.after(self.cursors)
        self.advance(agreed, self._step_started)
        self.after_step(agreed)
        self._step_loss, self._step_tokens = 0.0, 0
        self._step_started = time.monotonic()
        return self.loop.step >= self.stop_at

    def extra_columns(self) -> MetricsRow:
        window, self._window = self._window, {}
        return _rewards(window)

    def eval_at_start(self) -> None:
        if self.loop.step == 0:
            self.last_eval = self.evaluate()
            self.log_row({"step": 0, "eval_loss": self.last_eval, **self._eval_extra})

    def step_row(self, a: Agreed) -> tuple[MetricsRow, bool]:
        row, last = super().step_row(a)
        if "eval_loss" in row:
            row |= self._eval_extra
        return row, last

    def evaluate(self, rows=None) -> float:
        """DPO's loss on the held-out pairs (reward accuracy beside it) for preference records, else the native
        eval (mean loss per target token)."""
        if not self.preference:
            return super().evaluate(rows)
        self.enter_phase("evaluating")
        loss, metrics = dpo_eval(self, rows or self.eval_rows)
        self._eval_extra = {"eval_" + k: v for k, v in _rewards(metrics).items() if k == "reward_accuracy"}
        return loss


def _rewards(metrics: dict[str, list[float]]) -> dict[str, float]:
    """TRL's reward accuracy and margin (per micro-batch, already averaged over the ranks), averaged."""
    names = {"rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin"}
    return {names[k]: sum(v) / len(v) for k, v in metrics.items() if k in names and v}


def dpo_eval(owner: HfTrainer, rows) -> tuple[float, dict[str, list[float]]]:
    """DPO's mean loss over ``rows`` (each rank its slice, every rank as many batches: TRL gathers inside), and
    TRL's eval metrics of it."""
    import numpy as np
    import torch

    from ray_jobs.data.preference import pair_batch
    from ray_jobs.train.eval import eval_batches

    engine, rt, t = owner.engine(), owner.rt, owner.cfg.train
    # TRL gathers per-pair tensors across ranks (no padding): every rank's batches must be the same size, so each
    # takes an equal slice and the last len(rows) % world_size pairs are left out (none at one worker)
    usable = len(rows) - len(rows) % rt.world_size
    mine, mb = np.arange(rt.rank, usable, rt.world_size), t.micro_batch_size
    engine.model_wrapped.eval()
    engine._metrics["eval"].clear()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(eval_batches(usable, rt.world_size, mb, t.eval_max_batches)):
            idx = mine[b * mb : b * mb + mb]
            batch = engine._prepare_inputs(pair_batch(*rows.take(idx), owner.pad_id))
            loss = float(engine.compute_loss(engine.model_wrapped, batch))
            total, count = total + loss * len(idx), count + len(idx)
    total, count = rt.all_reduce_sum([total, float(count)])
    metrics = {k: list(v) for k, v in engine._metrics["eval"].items()}
    engine._metrics["eval"].clear()
    return total / max(count, 1.0), metrics


def hf_trainer(owner: HfTrainer, steps: int):
    """HF's ``Trainer`` (TRL's ``DPOTrainer`` for preference records) over ``owner``'s model, optimizer, schedule and
    rows, training ``steps`` optimizer steps."""
    import transformers

    base = _dpo_trainer() if owner.preference else transformers.Trainer

    class Engine(base):
        def get_train_dataloader(self):
            import torch
            from torch.utils.data import DataLoader

            # already this worker's micro-batches, in order; a generator of its own: making the iterator draws a
            # seed, which from the global RNG would shift a resumed run's dropout and NEFTune noise by one draw
            return DataLoader(Batches(owner), batch_size=None, generator=torch.Generator())

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            owner._step_loss += float(loss)  # HF's own per-micro-batch loss: their sum is the step's, as HF logs it
            return loss

        def _get_grad_norm(self, model, grad_norm=None):
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            owner._grad_norm = float(norm) if norm is not None else 0.0
            return norm

    kwargs = dict(
        model=owner.model,
        args=training_arguments(owner, steps),
        callbacks=[Hooks(owner)],
        optimizers=(owner.optimizer, owner.scheduler),
    )
    if owner.preference:
        kwargs |= _dpo_kwargs(owner)
    engine = Engine(**kwargs)
    engine.remove_callback(transformers.PrinterCallback)  # its summary line: unbroken's log says what was trained
    if owner.preference and owner.lora:
        _reference_is_the_base(engine)
    return engine


def _dpo_trainer():
    from trl import DPOTrainer

    return DPOTrainer


def _dpo_kwargs(owner: HfTrainer) -> dict[str, Any]:
    """What TRL's DPOTrainer needs beyond HF's: the tokenizer, the reference (a frozen copy of the base for a full
    fine-tune; under LoRA, none: the adapters disabled), and a dataset -- it insists on one and tokenizes it at
    construction, while the rows it trains come staged through ``get_train_dataloader``: one placeholder pair."""
    from datasets import Dataset

    from ray_jobs.model.loading import load_model_fp32, load_tokenizer

    out = {
        "processing_class": load_tokenizer(owner.model_path, owner.cfg.data.cache_dir),  # the node's copy
        "train_dataset": Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}]),
    }
    if not owner.lora:
        ref = load_model_fp32(owner.model_path, owner.cfg.data.cache_dir).to(owner.device).eval()
        out["ref_model"] = ref.requires_grad_(False)
    return out


def _reference_is_the_base(engine) -> None:
    """TRL keeps a frozen copy of the adapters as the reference ("ref"); made after a resume, that copy would be the
    trained adapters. Without it TRL disables the adapters for the reference: the base model, whatever the step."""
    model = engine.accelerator.unwrap_model(engine.model)
    if "ref" in model.peft_config:
        model.delete_adapter("ref")
        model.set_adapter("default")


def training_arguments(owner: HfTrainer, steps: int):
    """HF's arguments: what unbroken owns set from its config (``ray_jobs.config.engine.OWNED``), then
    ``train.hf_args``."""
    import tempfile

    from transformers import TrainingArguments

    cfg, device = owner.cfg, owner.device
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    if owner.preference:
        from trl import DPOConfig as TrainingArguments
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="unbroken-hf-"),  # HF writes nothing there: saving is unbroken's
        max_steps=steps,
        per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=owner.plan.micro_batches,
        max_grad_norm=cfg.train.max_grad_norm,
        learning_rate=cfg.train.lr,
        seed=cfg.train.seed,
        bf16=bf16,
        use_cpu=device.type == "cpu",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        ignore_data_skip=True,
        gradient_checkpointing=False,  # build_model applies train.gradient_checkpointing (DPOConfig defaults to on)
        **_known(TrainingArguments, cfg.train.hf_args),
    )


def _known(args_class, hf_args: dict[str, Any]) -> dict[str, Any]:
    """``hf_args`` when every one is a field of ``args_class``; with ``data.format: auto`` they were checked against
    DPOConfig (the records could have been preference pairs), so a DPO-only one on other records is named here."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(args_class)}
    if unknown := sorted(set(hf_args) - fields):
        raise ValueError(
            f"train.hf_args: {', '.join(unknown)}: DPO's only, and data.format=auto found records that "
            "are not preference pairs"
        )
    return hf_args


def Hooks(owner: HfTrainer):  # noqa: N802 -- a callback class, built lazily (transformers is imported on the worker)
    """HF's callback into unbroken: each step's start (the injected test delay) and end (:meth:`HfTrainer.hf_step_end`)."""
    from transformers import TrainerCallback

    class _Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            faults.on_step()
            return control

        def on_step_end(self, args, state, control, **kw):
            if owner.hf_step_end():
                control.should_training_stop = True
            return control

    return _Hooks()


def Batches(owner: HfTrainer):  # noqa: N802 -- a dataset class, built lazily (torch is imported on the worker)
    from torch.utils.data import IterableDataset

    class _Batches(IterableDataset):
        """This worker's micro-batches from the cursor on: per step, the rows the native loop would take."""

        def __iter__(self):
            import numpy as np
            import torch

            from ray_jobs.data.preference import pair_batch

            plan, cursors = owner.plan, list(owner.cursors)
            while True:
                for micro in range(plan.micro_batches):
                    mb = plan.micro_batch(cursors, micro, owner.trace)
                    owner.rows_materialized += len(mb.idx)
                    if owner.preference:  # a pair past the last pass: no completion token counts (labels masked)
                        batch = pair_batch(*mb.rows, owner.pad_id, keep=mb.keep)
                        owner._step_tokens += int(batch["attention_mask"][np.concatenate([mb.keep, mb.keep])].sum())
                        yield batch
                        continue
                    ids, labels, pos = (torch.from_numpy(a) for a in mb.arrays)
                    owner._step_tokens += mb.tokens
                    yield {"input_ids": ids, "labels": labels, "position_ids": pos, "use_cache": False}
                cursors = plan.after(cursors)

    return _Batches()
