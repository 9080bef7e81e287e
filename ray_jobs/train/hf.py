"""The ``hf`` engine (``train.engine: hf``): Hugging Face ``transformers.Trainer`` runs each step -- its forward, its
loss (``compute_loss``, with whatever ``train.hf_args`` switch on: label smoothing, NEFTune, ...), its backward
through accelerate's DDP (or on unbroken's FSDP2 shards: :mod:`.hf_fsdp`), gradient clipping and the optimizer
step -- inside the same job as the native loop.

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

Every other ``train.method`` is a TRL trainer run the same way (its row in ``ray_jobs/config/methods.py``; its part
in :mod:`.trl_methods`): DPO on preference pairs (:mod:`ray_jobs.data.preference`), KTO on labelled completions
(:mod:`ray_jobs.data.unpaired`), a reward model's scalar head on preference pairs, GRPO sampling from the staged
prompts (:mod:`.grpo`), TRL's SFTTrainer. Its loss's options come through ``train.hf_args`` (checked against the
method's arguments class), and its metrics go to the metrics log under the row's column names (DPO's
``reward_accuracy`` and ``reward_margin``, GRPO's ``reward`` and one ``reward_<function>`` each...), once per step.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from ray_jobs import faults
from ray_jobs.checkpoint.rng import rng_state, set_rng_state
from ray_jobs.config.methods import load_class, method_of, reads, records_of
from ray_jobs.config.record_formats import staged_format
from ray_jobs.contracts.metrics import MetricsRow
from ray_jobs.train import model as models
from ray_jobs.train import trl_methods
from ray_jobs.train.hf_fsdp import keep_sharded, step_sync
from ray_jobs.train.model import Placement, global_norm
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
        fmt = staged_format(self.manifest.format)
        self.preference, self.method = fmt.pairs, method_of(self.cfg.train.method, fmt.pairs)
        if not reads(self.method, records_of(fmt) or "rows", fmt.documents):
            found = f"{self.manifest.format}, as data.format=auto found them"
            raise ValueError(f"train.method: {self.method.name} cannot train the staged records ({found})")
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

    def count_tokens(self, n: int) -> None:
        """Tokens trained on in the step (GRPO's sampled completions, known once sampled)."""
        self._step_tokens += n

    def hf_step_end(self) -> bool:
        """After HF's optimizer step: the native step's end (agree, advance, log, eval, checkpoint, preemption);
        True when training should stop here."""
        if self.method.metrics:  # TRL's per-micro-batch numbers, kept until the next logged row (not in TRL's lists)
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
        return trl_methods.columns(self.method, window)

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
        """The method's own loss on the held-out records, its eval metric beside it (DPO's, KTO's, a reward
        model's: :func:`.trl_methods.method_eval`), else the native eval (mean loss per target token)."""
        if not self.method.eval_metric:
            return super().evaluate(rows)
        self.enter_phase("evaluating")
        loss, self._eval_extra = trl_methods.method_eval(self, rows or self.eval_rows)
        return loss


def hf_trainer(owner: HfTrainer, steps: int):
    """HF's ``Trainer`` (the method's TRL trainer: :mod:`.trl_methods`) over ``owner``'s model, optimizer, schedule
    and rows, training ``steps`` optimizer steps."""
    import transformers

    base = trl_methods.trainer_class(owner)
    sync = step_sync(owner.fsdp, owner.plan.micro_batches)

    class Engine(base):
        def get_train_dataloader(self):
            import torch
            from torch.utils.data import DataLoader

            # already this worker's micro-batches, in order; a generator of its own: making the iterator draws a
            # seed, which from the global RNG would shift a resumed run's dropout and NEFTune noise by one draw
            return DataLoader(Batches(owner), batch_size=None, generator=torch.Generator())

        def training_step(self, model, inputs, num_items_in_batch=None):
            with sync(model):
                loss = super().training_step(model, inputs, num_items_in_batch)
            owner._step_loss += float(loss)  # HF's own per-micro-batch loss: their sum is the step's, as HF logs it
            return loss

        def _get_grad_norm(self, model, grad_norm=None):
            norm = global_norm(super()._get_grad_norm(model, grad_norm=grad_norm))  # a DTensor's under FSDP
            owner._grad_norm = float(norm) if norm is not None else 0.0
            return norm

    args, hooks, optimizers = training_arguments(owner, steps), [Hooks(owner)], (owner.optimizer, owner.scheduler)
    with trl_methods.quiet_datasets():  # a TRL trainer prepares its placeholder dataset: no progress bars for it
        engine = Engine(
            model=owner.model, args=args, callbacks=hooks, optimizers=optimizers, **trl_methods.construction(owner)
        )
    engine.remove_callback(transformers.PrinterCallback)  # its summary line: unbroken's log says what was trained
    trl_methods.after_construction(engine, owner)
    if owner.fsdp:  # sharded by build_model: accelerate must not wrap it in DDP
        keep_sharded(engine, owner.rt)
    return engine


def training_arguments(owner: HfTrainer, steps: int):
    """HF's arguments (the method's class: TrainingArguments, DPOConfig, GRPOConfig...): what unbroken owns set from
    its config (``ray_jobs.config.engine.OWNED``), the method's fields that follow from it, then ``train.hf_args``."""
    import tempfile

    cfg, device = owner.cfg, owner.device
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    TrainingArguments = load_class(owner.method.args)  # noqa: N806 -- a class
    owned = dict(
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
    )
    return TrainingArguments(**owned | trl_methods.method_args(owner) | _known(TrainingArguments, cfg.train.hf_args))


def _known(args_class, hf_args: dict[str, Any]) -> dict[str, Any]:
    """``hf_args`` when every one is a field of ``args_class``; with ``data.format: auto`` they were checked against
    DPOConfig (the records could have been preference pairs), so a DPO-only one on other records is named here
    (a user error: the config, not the code)."""
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
            plan, cursors = owner.plan, list(owner.cursors)
            while True:
                if owner.method.records == "prompts":  # the step's prompts, at each micro-batch (grpo.py)
                    yield from itertools.repeat(prompts_of_step(owner, cursors), plan.micro_batches)
                    cursors = plan.after(cursors)
                    continue
                for micro in range(plan.micro_batches):
                    mb = plan.micro_batch(cursors, micro, owner.trace)
                    owner.rows_materialized += len(mb.idx)
                    yield trl_methods.micro_batch_inputs(owner, mb)  # its tokens counted
                cursors = plan.after(cursors)

    return _Batches()


def prompts_of_step(owner: HfTrainer, cursors) -> list[dict[str, Any]]:
    """This worker's prompts of the step at ``cursors``, as GRPO's generation batch (:func:`.grpo.generation_batch`)."""
    import numpy as np

    from ray_jobs.train.grpo import generation_batch

    plan, parts = owner.plan, []
    for micro in range(plan.micro_batches):
        mb = plan.micro_batch(cursors, micro, owner.trace)
        owner.rows_materialized += len(mb.idx)
        parts.append(mb.rows)  # (train.epochs, which masks a row past the last pass, is refused for grpo)
    rows = tuple(np.concatenate([p[k] for p in parts]) for k in range(3))
    return generation_batch(rows, owner.engine().processing_class, trl_methods.generations(owner))
