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
"""

from __future__ import annotations

import time

from ray_jobs.checkpoint.state import rng_state, set_rng_state
from ray_jobs.train import faults
from ray_jobs.train.model import build_model
from ray_jobs.train.trainer import Trainer


class _Unwrapped:
    """The runtime as the model builder sees it under the hf engine: accelerate, inside HF's Trainer, wraps the model
    in DDP; a model Ray Train had wrapped already would be wrapped twice."""

    def __init__(self, rt):
        self.rt = rt

    def prepare_model(self, model):
        return model

    def __getattr__(self, name: str):
        return getattr(self.rt, name)


class HfTrainer(Trainer):
    """The native trainer whose steps HF's ``Trainer`` computes (module docstring)."""

    def _build_model(self):
        return build_model(self.cfg, self.model_path, _Unwrapped(self.rt))

    def _train_to(self, end: int) -> None:
        if self.loop.step >= end:
            return
        self._step_loss, self._step_tokens, self._grad_norm = 0.0, 0, 0.0
        self._step_started = time.monotonic()
        self.stop_at = end
        rng = rng_state()  # HF's Trainer seeds every RNG as it is built: a resumed run's state comes back after
        hf = hf_trainer(self, end - self.loop.step)
        set_rng_state(rng)
        hf.train()

    def hf_step_end(self) -> bool:
        """After HF's optimizer step: the native step's end (agree, advance, log, eval, checkpoint, preemption);
        True when training should stop here."""
        agreed = self._agree(self._step_loss, self._step_tokens, self._grad_norm)
        self.cursors = self.plan.after(self.cursors)
        self._advance(agreed, self._step_started)
        self._after_step(agreed)
        self._step_loss, self._step_tokens = 0.0, 0
        self._step_started = time.monotonic()
        return self.loop.step >= self.stop_at


def hf_trainer(owner: HfTrainer, steps: int):
    """HF's ``Trainer`` over ``owner``'s model, optimizer, schedule and rows, training ``steps`` optimizer steps."""
    import transformers

    class Engine(transformers.Trainer):
        def get_train_dataloader(self):
            from torch.utils.data import DataLoader

            return DataLoader(Batches(owner), batch_size=None)  # already this worker's micro-batches, in order

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            owner._step_loss += float(loss)  # HF's own per-micro-batch loss: their sum is the step's, as HF logs it
            return loss

        def _get_grad_norm(self, model, grad_norm=None):
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            owner._grad_norm = float(norm) if norm is not None else 0.0
            return norm

    engine = Engine(model=owner.model, args=training_arguments(owner, steps), optimizers=(owner.optimizer,
                    owner.scheduler), callbacks=[Hooks(owner)])  # fmt: skip
    engine.remove_callback(transformers.PrinterCallback)  # its summary line: unbroken's log says what was trained
    return engine


def training_arguments(owner: HfTrainer, steps: int):
    """HF's arguments: what unbroken owns set from its config (``ray_jobs.config.engine.OWNED``), then
    ``train.hf_args``."""
    import tempfile

    from transformers import TrainingArguments

    cfg, device = owner.cfg, owner.device
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="unbroken-hf-"),  # HF writes nothing there: saving is unbroken's
        max_steps=steps, per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=owner.plan.micro_batches, max_grad_norm=cfg.train.max_grad_norm,
        learning_rate=cfg.train.lr, seed=cfg.train.seed, bf16=bf16, use_cpu=device.type == "cpu",
        save_strategy="no", eval_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        remove_unused_columns=False, dataloader_num_workers=0, ignore_data_skip=True,
        **cfg.train.hf_args,
    )  # fmt: skip


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
            import torch

            plan, cursors = owner.plan, list(owner.cursors)
            while True:
                for micro in range(plan.micro_batches):
                    v, idx, epochs = plan.batch(cursors, micro)
                    owner.rows_materialized += len(idx)
                    if owner.trace is not None:
                        owner.trace.add(epochs, plan.identify(v, idx))
                    ids, labels, pos = (torch.from_numpy(a) for a in plan.take(v, idx))
                    owner._step_tokens += int((ids != owner.pad_id).sum())
                    yield {"input_ids": ids, "labels": labels, "position_ids": pos, "use_cache": False}
                cursors = plan.after(cursors)

    return _Batches()
