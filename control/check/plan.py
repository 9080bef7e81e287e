"""What a run would be, worked out from its config and its model's shape alone: world size, batches, steps, tokens,
and an estimate of each worker's memory -- weights, gradients, optimizer state, activations, logits -- against what a
worker has. Pure arithmetic (table-tested); ``accelerate estimate-memory`` answers the same question for weights and
Adam alone.

The estimate follows how unbroken trains: fp32 master weights (4 bytes a parameter; a 4-bit base 0.5625, NF4 with
double quantization), fp32 gradients and AdamW's two fp32 moments for what trains, activations in the compute dtype
(bf16 on a GPU unless ``train.precision: fp32``) at about 17 values per token and hidden unit per layer without
activation checkpointing (Korthikanti et al. 2022, attention scores not kept: SDPA) and one layer's input per layer
with it, and the logits upcast to fp32 with their gradient (none with Liger's fused cross-entropy). FSDP shards
weights, gradients and optimizer state over the fewest workers. An estimate, not a measurement: the allocator,
the CUDA context and temporary buffers add to it.

Each ``train.method`` adds what it holds (its row in ``ray_jobs/config/methods.py``): a preference pair is two
sequences (DPO, reward models), KTO's mismatched completion a third pass without gradients; a frozen reference
(DPO, KTO; GRPO with ``beta`` > 0) is a full fp32 copy of the weights under a full fine-tune (sharded under FSDP;
none under LoRA: the adapters are disabled for it); GRPO trains on ``num_generations`` completions a prompt and
samples them all at once per step, holding their KV cache and their last position's logits; a reward model's head
has one output, not the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_jobs.config import Config
from ray_jobs.config.engines import engine_of, needs
from ray_jobs.config.methods import Method, method_of
from ray_jobs.config.record_formats import record_format

GB = 1024**3
ACTIVATION_VALUES = 17  # per token, per hidden unit, per layer, without activation checkpointing


@dataclass(frozen=True)
class ModelShape:
    params: int  # every parameter once (a tied matrix once)
    trainable: int  # what the optimizer updates: adapters (+ modules_to_save) under LoRA, else every parameter
    hidden: int
    layers: int
    vocab: int


@dataclass(frozen=True)
class Plan:
    workers: tuple[int, int]  # fewest, most (live recovery's standbys included)
    data_ranks: (
        int  # the data's ranks (cluster.num_workers, its max when elastic: fewer workers run more micro-batches)
    )
    micro_batch: int
    grad_accum: int
    seq_len: int
    steps: int
    memory: dict[str, float]  # part -> bytes per worker
    available: float | None  # bytes a worker has, when known
    available_from: str  # where that figure comes from
    method: str = ""  # what the run optimizes, as a line (its row's)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.data_ranks

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool | None:
        return None if self.available is None else self.total <= self.available

    def lines(self) -> list[str]:
        fewest, most = self.workers
        world = f"{fewest}" if fewest == most else f"{fewest}-{most}"
        tokens = self.global_batch * self.seq_len
        parts = ", ".join(f"{k} {gb(v)}" for k, v in self.memory.items())
        have = "unknown" if self.available is None else f"{gb(self.available)} ({self.available_from})"
        return [
            f"workers {world}; micro-batch {self.micro_batch} x grad-accum {self.grad_accum} x {self.data_ranks} = global "
            f"batch {self.global_batch} ({tokens:,} tokens a step at seq_len {self.seq_len}); {self.steps:,} steps",
            f"memory per worker, estimated: {gb(self.total)} ({parts}); a worker has {have}",
            *([self.method] if self.method else []),
        ]

    def problem(self) -> str | None:
        if self.fits is not False:
            return None
        big = max(self.memory, key=lambda k: self.memory[k])
        return (
            f"the run does not fit: about {gb(self.total)} per worker, {gb(self.available or 0)} available "
            f"({self.available_from}); the largest part is {big} ({gb(self.memory[big])}). What lowers it: "
            f"{', '.join(remedies(big))}"
        )


def remedies(part: str) -> list[str]:
    return {
        "weights": [
            "model.lora (train adapters)",
            "model.quantization: 4bit (with LoRA, on CUDA)",
            "train.parallelism: fsdp (shards them over the workers)",
            "a smaller model",
        ],
        "optimizer": ["model.lora", "train.parallelism: fsdp"],
        "gradients": ["model.lora", "train.parallelism: fsdp"],
        "activations": [
            "train.gradient_checkpointing: true",
            "a smaller train.micro_batch_size (raise train.grad_accum_steps to keep the batch)",
            "a shorter data.seq_len",
        ],
        "logits": ["a smaller train.micro_batch_size", f"{needs('hf_args')} with hf_args.use_liger_kernel (CUDA)"],
        "reference": [
            "model.lora (the reference is then the base, adapters disabled: no copy)",
            "train.parallelism: fsdp (shards it)",
        ],
        "generation": [
            "a smaller train.micro_batch_size or train.grad_accum_steps (prompts sampled at once)",
            "train.hf_args.num_generations",
            "train.hf_args.max_completion_length",
        ],
    }[part]


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1024**2:.0f} MB"


def memory(cfg: Config, shape: ModelShape, gpu: bool) -> dict[str, float]:
    """Bytes per worker, by part (module docstring)."""
    t, fewest, method = cfg.train, cfg.workers[0], method_in(cfg)
    shard = fewest if t.parallelism == "fsdp" else 1
    base = shape.params - shape.trainable
    weights = (base * 0.5625 if cfg.model.quantization == "4bit" else base * 4.0) + shape.trainable * 4.0
    act_bytes = 2 if gpu and t.precision != "fp32" else 4
    sequences, length = trained_sequences(cfg, method)
    tokens = sequences * length
    per_layer = 1 if t.gradient_checkpointing else ACTIVATION_VALUES
    activations = tokens * shape.hidden * act_bytes * (per_layer * shape.layers + (ACTIVATION_VALUES - per_layer))
    liger = engine_of(cfg).hf_args and bool(t.hf_args.get("use_liger_kernel"))
    outputs = 1 if method.reward_head else shape.vocab
    out = {
        "weights": weights / shard,
        "gradients": shape.trainable * 4.0 / shard,
        "optimizer": shape.trainable * 8.0 / shard,
        "activations": float(activations),
        "logits": 0.0 if liger else tokens * outputs * 4.0 * 2,
    }
    if has_reference(cfg, method):
        out["reference"] = shape.params * 4.0 / shard
    if method.generates:
        out["generation"] = generation_bytes(cfg, shape, act_bytes)
    return out


def method_in(cfg: Config) -> Method:
    """The config's method (``auto`` read from its records' format)."""
    return method_of(cfg.train.method, record_format(cfg.data.format).pairs)


def has_reference(cfg: Config, method: Method) -> bool:
    """Whether the method keeps a frozen copy of the weights: DPO's and KTO's reference, GRPO's when its KL term is
    on (``beta`` > 0); never under LoRA (the adapters are disabled for the reference)."""
    wanted = method.reference or (method.generates and float(cfg.train.hf_args.get("beta", 0.0)) > 0)
    return wanted and cfg.model.lora is None


def generations(cfg: Config) -> tuple[int, int]:
    """GRPO's completions a prompt and their longest length (TRL's defaults: 8 and 256)."""
    hf = cfg.train.hf_args
    return int(hf.get("num_generations", 8)), int(hf.get("max_completion_length", 256))


def trained_sequences(cfg: Config, method: Method) -> tuple[int, int]:
    """Sequences a forward with gradients takes at once, and their length: a micro-batch's rows, a pair's two
    sequences, GRPO's completions (prompt and completion)."""
    t = cfg.train
    if method.generates:
        count, length = generations(cfg)
        return t.micro_batch_size * count, cfg.data.seq_len + length
    return t.micro_batch_size * (2 if method.records == "pairs" else 1), cfg.data.seq_len


def generation_bytes(cfg: Config, shape: ModelShape, act_bytes: int) -> float:
    """GRPO's sampling: every completion of a step at once (a step's micro-batches), their KV cache (keys and values
    per layer, at full hidden width: no grouped-query saving assumed) and one position's logits a completion."""
    count, length = generations(cfg)
    completions = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * count
    kv = completions * (cfg.data.seq_len + length) * shape.layers * 2 * shape.hidden * act_bytes
    return float(kv + completions * shape.vocab * 4.0)


def plan(cfg: Config, shape: ModelShape, gpu: bool, available: float | None, available_from: str) -> Plan:
    t = cfg.train
    return Plan(
        cfg.workers,
        cfg.cluster.max_workers,
        t.micro_batch_size,
        t.grad_accum_steps,
        cfg.data.seq_len,
        t.max_steps,
        memory(cfg, shape, gpu),
        available,
        available_from,
        method_line(cfg),
    )


def method_line(cfg: Config) -> str:
    """What the run optimizes: ``method grpo: ...``."""
    m = method_in(cfg)
    extra = f"; {generations(cfg)[0]} completions a prompt" if m.generates else ""
    return f"method {m.name}: {m.what}{extra}"
