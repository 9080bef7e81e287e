"""``train.parallelism: fsdp`` under the ``hf`` engine (:mod:`.hf`): HF's ``Trainer`` computes each step on a model
unbroken's FSDP2 sharded before HF saw it -- the native loop's sharding (``build_model``:
:func:`~ray_jobs.train.runtime.shard_with_fsdp`, each decoder block, then the root) -- and accelerate leaves it so.

Why not accelerate's own FSDP plugin (``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``):

- it does not run on CPU: accelerate honours an FSDP plugin only on accelerator devices; a gloo run over CPU workers
  is ``MULTI_CPU``, where the plugin is dropped without a word and the model wrapped in DDP (tried: accelerate 1.15,
  transformers 5.23);
- HF's ``Trainer`` refuses ``optimizers=`` once its FSDP is on, and accelerate shards the model inside ``train()``:
  after unbroken's resume, which loads each rank's own shards into the sharded model and its optimizer, built over
  the sharded parameters (``Trainer.__init__`` builds the model, then the optimizer).

So the model, the optimizer and the checkpoints are the native FSDP run's (each rank writes and reads its own
shards), and here:

- :func:`keep_sharded`: accelerate prepares the model for mixed precision only (``prepare_model(...,
  evaluation_mode=True)``, as transformers does for a model sharded at load time); a prepared model is not prepared
  again when ``train()`` starts. Left to ``train()``, accelerate wraps the sharded model in DDP, whose first broadcast
  fails on its DTensors (tried). TRL's frozen reference (DPO, a full fine-tune) is sharded the same way -- loaded
  whole, as the policy is, then sharded: a whole copy kept on every rank is the memory FSDP is there to save;
- :class:`StepSync`: a step's gradients are reduce-scattered once, on its last micro-batch, as in the native loop
  (accelerate's ``no_sync`` is DDP's, which an FSDP2 module lacks: every micro-batch would reduce-scatter);
- HF clips the gradients with ``clip_grad_norm_`` over their DTensors, as the native loop does (accelerate's
  ``clip_grad_norm_`` on ``MULTI_CPU``/``MULTI_GPU``); the norm, a DTensor, is made a plain tensor for the metrics row
  (:func:`~ray_jobs.train.model.global_norm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

from ray_jobs.train.model import Placement, grad_sync


def keep_sharded(engine, rt: Placement) -> None:
    """After HF's (or TRL's) ``Trainer`` is built over the sharded model: accelerate's mixed precision on it and
    nothing else, ``generate`` through FSDP's hooks (a method that samples calls it), and TRL's reference sharded
    like it."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    engine.accelerator.prepare_model(engine.model, device_placement=False, evaluation_mode=True)
    if hasattr(engine.model, "generate"):  # gathers the shards around each call, as forward does
        register_fsdp_forward_method(engine.model, "generate")
    reference = getattr(engine, "ref_model", None)  # TRL's: frozen, already placed and prepared for evaluation
    if reference is not None and isinstance(rt.shard_model(reference), FSDPModule):
        # the root's own weights (embeddings, head) too: FSDP keeps a root whole after forward, for the backward a
        # reference never runs
        reference.set_reshard_after_forward(True)


class StepSync:
    """Gradients reduce-scattered on a step's last micro-batch only: ``with sync(model):`` around each micro-batch's
    forward and backward, ``micro_batches`` of them a step (HF's ``gradient_accumulation_steps``). The engine is
    built at a step's start, and HF ends each step after its last micro-batch: the count is the step's."""

    def __init__(self, micro_batches: int):
        self.micro_batches, self.seen = micro_batches, 0

    @contextlib.contextmanager
    def __call__(self, model) -> Generator[None]:
        last = self.seen % self.micro_batches == self.micro_batches - 1
        with grad_sync(model, fsdp=True, sync=last):
            yield
        self.seen += 1


def step_sync(fsdp: bool, micro_batches: int) -> Callable[[Any], contextlib.AbstractContextManager]:
    """What the engine wraps each micro-batch in: :class:`StepSync` under FSDP; under DDP, nothing (accelerate's
    ``no_sync`` defers the all-reduce)."""
    return StepSync(micro_batches) if fsdp else (lambda model: contextlib.nullcontext())
