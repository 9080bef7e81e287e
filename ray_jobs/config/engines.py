"""The training engines, as data: one row per engine saying what it can run, read by the config's checks
(``ray_jobs/config/engine.py``), the planner and the workers instead of branches on the engine's name.

An engine is chosen by ``train.engine``, or by a switch of its own: live recovery (``fault_tolerance.live_recovery``)
runs the native loop's steps as torchft replicas. Its trainer is the native :class:`~ray_jobs.train.trainer.Trainer`
or a subclass overriding the hooks :class:`~ray_jobs.train.engine.EngineHooks` names.

A new engine is one module (its trainer) plus one row here, and its name in :data:`EngineName` when ``train.engine``
chooses it (the config reference lists the choices from that literal; a test holds the two equal)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

EngineName = Literal["native", "hf"]  # ``train.engine``'s choices: the rows without a switch


@dataclass(frozen=True)
class Engine:
    """One training engine: where its trainer is, and what it can run (each capability a config may ask for)."""

    name: str
    trainer: str  # its trainer class, "module:Class", imported by the worker alone (torch, transformers)
    about: str  # one line: who runs each step
    switch: str | None = None  # the config flag that chooses it instead of ``train.engine`` ("section.field")
    fsdp: bool = False  # shards the model (``train.parallelism: fsdp``); else DDP only
    lora: bool = True  # trains LoRA adapters (``model.lora``)
    quantization: bool = True  # trains adapters on a 4-bit base (``model.quantization: 4bit``)
    preference: bool = False  # trains preference pairs (DPO): records whose format has ``pairs``
    hf_args: bool = False  # reads ``train.hf_args`` (HF's TrainingArguments: ``use_liger_kernel`` fuses the loss)
    live_recovery: bool = False  # ``fault_tolerance.live_recovery`` can run its steps
    standbys: bool = False  # takes standby replicas (``fault_tolerance.standby_replicas``)
    torchft: bool = False  # its replicas are torchft's: the job runs torchft's lighthouse
    own_heartbeat: bool = False  # writes rank 0's heartbeat itself (from whoever leads), so the worker starts none
    local_mode: bool = True  # runs in local mode (torchrun or one process: no Ray Train)
    # capability it lacks -> the refusal a config asking for it gets, where the general one (engine.REFUSALS) says
    # too little of why
    refusals: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def chooser(self) -> str:
        """The config field that chooses this engine."""
        return self.switch or "train.engine"

    @property
    def chosen_by(self) -> str:
        """That field as set to choose it: ``train.engine=hf``, ``fault_tolerance.live_recovery=true``."""
        return f"{self.switch}=true" if self.switch else f"train.engine={self.name}"


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(
            "native",
            "ray_jobs.train.trainer:Trainer",
            "unbroken's own loop: forward, loss, backward and optimizer step",
            fsdp=True,
            live_recovery=True,
        ),
        Engine(
            "hf",
            "ray_jobs.train.hf:HfTrainer",
            "Hugging Face's Trainer (TRL's DPOTrainer on preference pairs) computes each step through accelerate's "
            "DDP, or on unbroken's FSDP2 shards; unbroken feeds the rows and owns the optimizer, the checkpoints, the "
            "heartbeat and the metrics",
            fsdp=True,
            preference=True,
            hf_args=True,
        ),
        Engine(
            "live",
            "ray_jobs.train.live_trainer:LiveTrainer",
            "the native loop as torchft replicas: a lost worker is replaced while the others keep stepping",
            switch="fault_tolerance.live_recovery",
            live_recovery=True,
            standbys=True,
            torchft=True,
            own_heartbeat=True,
            quantization=False,
            local_mode=False,
            refusals={
                "fsdp": "fault_tolerance.live_recovery: needs train.parallelism=ddp (a replica is one worker holding "
                "the whole model; under FSDP a worker holds a shard, and a lost shard restarts every worker from the "
                "last checkpoint)",
                "quantization": "model.quantization: 4bit is not supported with fault_tolerance.live_recovery yet (a "
                "replica is healed from its peer's state; not shown for a 4-bit base): the watchdog and Ray Train's "
                "restarts cover it",
                "local_mode": "fault_tolerance.live_recovery: needs Ray Train (it replaces a lost worker's replica "
                "group while the others step on); local mode runs a fixed set of processes that end together (set it "
                "to false, or use `unbroken run`)",
            },
        ),
    )
}


def engine_of(cfg: Any) -> Engine:
    """The engine that runs ``cfg``: the one whose switch is on (live recovery), else ``train.engine``'s."""
    for engine in ENGINES.values():
        if engine.switch and _flag(cfg, engine.switch):
            return engine
    return ENGINES[cfg.train.engine]


def needs(capability: str) -> str:
    """How a config chooses an engine that has ``capability`` (``train.engine=hf``): those ``train.engine`` chooses,
    else those a switch does."""
    chosen = [e.chosen_by for e in ENGINES.values() if getattr(e, capability) and not e.switch]
    return " or ".join(chosen or [e.chosen_by for e in ENGINES.values() if getattr(e, capability)])


def _flag(cfg: Any, dotted: str) -> bool:
    section, _, name = dotted.partition(".")
    return bool(getattr(getattr(cfg, section), name))
