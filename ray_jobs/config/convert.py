"""Another tool's training config as unbroken's: Axolotl's YAML and TRL's (``trl sft --config``: the fields of
TrainingArguments / SFTConfig, ScriptArguments and ModelConfig), key by key.

The mapping is data: one table per flavour, a :class:`Row` per key -- the key, the unbroken field it sets (None: a key
unbroken does not honour), how its value becomes the field's (None: as written) and a note. A row without a field says
why in its note: ``not needed: ...`` where unbroken does it anyway, ``not supported: ...`` where it cannot. The tables
are the one source of truth of ``unbroken convert`` (unbroken/convert.py), of the config's "did you mean" for another
tool's key (loading.py) and of the config reference's "Axolotl / TRL name" column (reference.py). Pure: pyyaml, no
torch, Prefect or Ray.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ray_jobs.config import convert_values as how
from ray_jobs.config.convert_values import Cannot, Context, Fields, run_name
from ray_jobs.errors import UserError

Flavour = Literal["axolotl", "trl"]
TOOL: dict[Flavour, str] = {"axolotl": "Axolotl", "trl": "TRL"}
# Top-level keys that only one tool's configs have: how a file's flavour is told (the one with more of them).
MARKS: dict[Flavour, tuple[str, ...]] = {
    "axolotl": ("base_model", "datasets", "micro_batch_size", "sequence_len", "num_epochs", "adapter"),
    "trl": ("model_name_or_path", "per_device_train_batch_size", "dataset_name", "num_train_epochs", "use_peft"),
}
# The written config's sections, in the order its reference lists them.
ORDER = ("name", "series", "storage", "data", "model", "train", "checkpoint", "cluster", "fault_tolerance", "tracking")
DEFAULT_STORAGE = ".unbroken/storage"


class Unconvertible(UserError):
    """A file ``unbroken convert`` cannot read, or whose tool it cannot tell."""


class Row(NamedTuple):
    key: str  # the other tool's
    field: str | None  # unbroken's, dotted; None: not honoured (the note says why)
    how: Callable[[Any, Context], Any] | None  # the value -> the field's (or Fields, or None: nothing to set)
    note: str


ATTENTION = (
    "not needed: transformers picks the attention kernel (SDPA); packed examples are kept apart by their position_ids"
)
PACKING = "not needed: unbroken always packs records into data.seq_len rows, each example apart from the others"
ARCH = "not needed: read from the model's own config.json"
STEPS = "not supported: unbroken counts in steps"
DEEPSPEED = (
    "not supported: DeepSpeed owns the optimizer and writes checkpoints of its own, which unbroken's sealed "
    "checkpoints and exact resume do not cover; train.parallelism: fsdp shards a model too big for a device"
)
ADAMW = "not needed for an AdamW: unbroken steps with torch's AdamW; another optimizer is not supported"
HUB = "not supported: the final model is written to storage (runs/<name>/final); push it from there"
RESUME = "not needed: every start of an unbroken run resumes from its newest valid checkpoint"
TOKENS = (
    "not supported: unbroken trains with the model's tokenizer as it is: add the tokens with "
    "tokenizer.add_special_tokens, save_pretrained it beside the model and point the model there"
)
FSDP_OPTIONS = "not supported: unbroken's FSDP2 has no options of its own (each decoder layer a unit, fully sharded)"
STORAGE = "unbroken writes under it: runs/<name>/ (checkpoints, the final model), datasets/ (staged data)"
WANDB = "offline unless tracking.wandb.mode: online (W&B reads WANDB_API_KEY, WANDB_ENTITY on the workers)"
FP16 = "not supported: unbroken computes in bf16 or fp32 (train.precision), not fp16"
EIGHT_BIT = "not supported: unbroken quantizes a base in 4-bit only (model.quantization: 4bit, with LoRA)"
LORA_EXTRAS = "not supported: unbroken's LoRA is plain LoRA (r, alpha, dropout, targets)"
TEMPLATE = (
    "not supported: chat records are rendered with the tokenizer's own chat template; save the template in "
    "the tokenizer's folder"
)
REMOTE = "not supported: unbroken loads models that transformers knows, without a repository's own code"

# The keys both tools spell alike (transformers' TrainingArguments, PEFT's LoraConfig), in one place.
BOTH: tuple[Row, ...] = (
    Row("lora_r", "model.lora.r", how.lora, ""),
    Row("lora_alpha", "model.lora.alpha", how.lora, ""),
    Row("lora_dropout", "model.lora.dropout", how.lora, ""),
    Row("lora_target_modules", "model.lora.target_modules", how.lora, ""),
    Row("lora_modules_to_save", "model.lora.modules_to_save", how.lora, ""),
    Row("load_in_4bit", "model.quantization", how.four_bit, ""),
    Row("max_steps", "train.max_steps", how.steps, ""),
    Row("gradient_accumulation_steps", "train.grad_accum_steps", how.whole, ""),
    Row("learning_rate", "train.lr", how.number, ""),
    Row("warmup_steps", "train.warmup_steps", how.whole, ""),
    Row("warmup_ratio", "train.warmup_steps", how.warmup_ratio, ""),
    Row("weight_decay", "train.weight_decay", how.number, ""),
    Row("max_grad_norm", "train.max_grad_norm", how.number, ""),
    Row("seed", "train.seed", how.whole, ""),
    Row("bf16", "train.precision", how.precision, ""),
    Row("gradient_checkpointing", "train.gradient_checkpointing", how.flag, ""),
    Row("torch_compile", "train.compile", how.flag, ""),
    Row("fsdp", "train.parallelism", how.fsdp, "unbroken's FSDP2: each decoder layer a unit, fully sharded"),
    Row("eval_steps", "train.eval_every_steps", how.whole, ""),
    Row("logging_steps", "train.log_every_steps", how.whole, ""),
    Row("save_steps", "checkpoint.every_steps", how.whole, ""),
    Row("save_total_limit", "checkpoint.num_to_keep", how.whole, ""),
    Row("output_dir", "storage", None, STORAGE),
    Row("fp16", None, None, FP16),
    Row("tf32", None, None, "not needed: unbroken computes in fp32 or bf16 (train.precision)"),
    Row("load_in_8bit", None, None, EIGHT_BIT),
    Row("deepspeed", None, None, DEEPSPEED),
    Row("fsdp_config", None, None, FSDP_OPTIONS),
    Row("trust_remote_code", None, None, REMOTE),
    Row("resume_from_checkpoint", None, None, RESUME),
    Row("hub_model_id", None, None, HUB),
    Row("push_to_hub", None, None, HUB),
)  # fmt: skip

AXOLOTL: tuple[Row, ...] = (
    Row("base_model", "model.name_or_path", None, ""),
    Row("datasets", "data.train", how.datasets, ""),
    Row("test_datasets", "data.eval", how.test_datasets, ""),
    Row("val_set_size", "data.eval_fraction", how.fraction, ""),
    Row("sequence_len", "data.seq_len", how.whole, ""),
    Row("dataset_processes", "data.workers", how.whole, ""),
    Row("adapter", "model.lora", how.adapter, ""),
    *BOTH,
    Row("lora_target_linear", "model.lora.target_modules", how.all_linear, ""),
    Row("num_epochs", "train.epochs", how.epochs, ""),
    Row("micro_batch_size", "train.micro_batch_size", how.whole, ""),
    Row("lr_scheduler", "train.lr_schedule", how.schedule, ""),
    Row("wandb_project", "tracking.wandb.project", None, WANDB),
    Row("wandb_mode", "tracking.wandb.mode", how.wandb_mode, ""),
    Row("wandb_entity", None, None, "not supported: tracking.wandb has no entity; W&B reads WANDB_ENTITY"),
    Row("wandb_name", None, None, "not needed: the W&B run is named after the unbroken run (name)"),
    Row("wandb_watch", None, None, "not supported: W&B gets the run's metrics, not the model's gradients"),
    Row("wandb_log_model", None, None, "not supported: the final model is written to storage, not to W&B"),
    Row("flash_attention", None, None, ATTENTION),
    Row("sdp_attention", None, None, ATTENTION),
    Row("xformers_attention", None, None, ATTENTION),
    Row("s2_attention", None, None, ATTENTION),
    Row("sample_packing", None, None, PACKING),
    Row("eval_sample_packing", None, None, PACKING),
    Row("pad_to_sequence_len", None, None, PACKING),
    Row("group_by_length", None, None, PACKING),
    Row("train_on_inputs", None, how.train_on_inputs, "not needed: unbroken masks the prompt from the loss"),
    Row("optimizer", None, how.optimizer, ADAMW),
    Row("special_tokens", None, None, TOKENS),
    Row("tokens", None, None, TOKENS),
    Row("chat_template", None, None, TEMPLATE),
    Row("tokenizer_config", None, None, "not supported: the tokenizer is the model's own (base_model)"),
    Row("tokenizer_type", None, None, ARCH),
    Row("model_type", None, None, ARCH),
    Row("base_model_config", None, None, ARCH),
    Row("is_llama_derived_model", None, None, ARCH),
    Row("lora_model_dir", None, None, "not supported: a run starts from a base model (merge the adapters into it)"),
    Row("lora_fan_in_fan_out", None, None, LORA_EXTRAS),
    Row("peft_use_dora", None, None, LORA_EXTRAS),
    Row("peft_use_rslora", None, None, LORA_EXTRAS),
    Row("lr_scheduler_kwargs", None, None, "not supported: train.lr_schedule takes no options"),
    Row("evals_per_epoch", "train.evals_per_epoch", how.whole, ""),
    Row("saves_per_epoch", "checkpoint.saves_per_epoch", how.whole, ""),
    Row("eval_batch_size", None, None, "not needed: eval runs in train.micro_batch_size batches"),
    Row("early_stopping_patience", None, None, "not supported: a run trains its steps (the series' gate judges it)"),
    Row("auto_resume_from_checkpoints", None, None, RESUME),
    Row("dataset_prepared_path", None, None, "not needed: staged data is kept under storage (datasets/<id>)"),
    Row("neftune_noise_alpha", None, None, "not supported by the native loop; with train.engine: hf, train.hf_args"),
    Row("strict", None, None, "not needed: unbroken refuses any key it does not know"),
    Row("debug", None, None, "not needed: unbroken logs what it stages (--debug shows tracebacks)"),
    Row("local_rank", None, None, "not needed: Ray Train (or torchrun) gives each worker its rank"),
)  # fmt: skip

TRL: tuple[Row, ...] = (
    Row("model_name_or_path", "model.name_or_path", None, ""),
    Row("dataset_name", "data.train", how.dataset_name, ""),
    Row("dataset_text_field", "data.text_field", None, ""),
    Row("max_length", "data.seq_len", how.whole, ""),
    Row("max_seq_length", "data.seq_len", how.whole, ""),
    Row("use_peft", "model.lora", how.peft, ""),
    *BOTH,
    Row("num_train_epochs", "train.epochs", how.epochs, ""),
    Row("per_device_train_batch_size", "train.micro_batch_size", how.whole, ""),
    Row("lr_scheduler_type", "train.lr_schedule", how.schedule, ""),
    Row("run_name", "name", how.as_run_name, ""),
    Row("report_to", "tracking", how.report_to, ""),
    Row("packing", None, None, PACKING),
    Row("padding_free", None, None, PACKING),
    Row("completion_only_loss", None, None, "not needed: a prompt is masked from the loss, its completion learned"),
    Row("assistant_only_loss", None, None, "not needed: a chat's assistant turns are learned (data.train_on)"),
    Row("dataset_config", "data.train.subset", how.hub_option("subset"), ""),
    Row("dataset_train_split", "data.train.split", how.hub_option("split"), ""),
    Row("dataset_test_split", None, None, "not supported: data.eval is a file or folder (or eval_fraction of train)"),
    Row("bnb_4bit_quant_type", None, None, "not needed: model.quantization: 4bit is NF4"),
    Row("use_bnb_nested_quant", None, None, "not needed: model.quantization: 4bit quantizes twice (double quantization)"),
    Row("dtype", None, None, "not needed: the base is loaded in fp32 (train.precision sets the compute)"),
    Row("torch_dtype", None, None, "not needed: the base is loaded in fp32 (train.precision sets the compute)"),
    Row("attn_implementation", None, None, ATTENTION),
    Row("use_rslora", None, None, LORA_EXTRAS),
    Row("use_dora", None, None, LORA_EXTRAS),
    Row("model_revision", None, None, "not supported: model.name_or_path names the model; save a revision to a folder"),
    Row("optim", None, how.optimizer, ADAMW),
    Row("chat_template_path", None, None, TEMPLATE),
    Row("per_device_eval_batch_size", None, None, "not needed: eval runs in train.micro_batch_size batches"),
    Row("eval_strategy", "train.evals_per_epoch", how.per_epoch("eval"), ""),
    Row("save_strategy", "checkpoint.saves_per_epoch", how.per_epoch("save"), ""),
    Row("logging_strategy", None, None, f"{STEPS}: train.log_every_steps"),
    Row("logging_dir", None, None, "not needed: trackers write under storage (tracking.tensorboard.dir)"),
    Row("overwrite_output_dir", None, None, "not needed: a run's folder is its own (runs/<name>)"),
)  # fmt: skip

TABLES: dict[Flavour, tuple[Row, ...]] = {"axolotl": AXOLOTL, "trl": TRL}


def flavour_of(raw: dict[str, Any]) -> Flavour | None:
    """The tool a config's top-level keys are another's of, or None (unbroken's own, or no telling)."""
    hits = {f: sum(k in raw for k in marks) for f, marks in MARKS.items()}
    best = max(hits.values())
    found = [f for f, n in hits.items() if n == best]
    return found[0] if best and len(found) == 1 else None


def other_names(key: str) -> dict[str | None, list[tuple[Flavour, Row]]]:
    """What ``key`` is in the tools' tables: the unbroken field it sets (None: not honoured) -> (tool, row) of each."""
    out: dict[str | None, list[tuple[Flavour, Row]]] = {}
    for flavour, rows in TABLES.items():
        for row in rows:
            if row.key == key:
                out.setdefault(row.field, []).append((flavour, row))
    return out


def names_by_field() -> dict[str, list[tuple[Flavour, str]]]:
    """Unbroken's dotted field -> (tool, key) of each key that sets it, for the config reference."""
    out: dict[str, list[tuple[Flavour, str]]] = {}
    for flavour, rows in TABLES.items():
        for row in rows:
            if row.field is not None:
                out.setdefault(row.field, []).append((flavour, row.key))
    return out


@dataclass
class Conversion:
    """What a file became: the config's tree, and what happened to each of its keys."""

    flavour: Flavour
    tree: dict[str, Any] = field(default_factory=dict)
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)  # (key, field, value)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (key, a note on how it was mapped)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (key, why it is not honoured)
    unknown: list[str] = field(default_factory=list)  # keys of no row
    empty: list[str] = field(default_factory=list)  # keys with no value, off, or unbroken's default

    def ordered(self) -> dict[str, Any]:
        return {k: self.tree[k] for k in sorted(self.tree, key=lambda k: ORDER.index(k) if k in ORDER else 99)}


def convert(source: dict[str, Any], flavour: Flavour, folder: Path, stem: str) -> Conversion:
    """``source`` (a file's YAML, read) as an unbroken config tree; ``folder`` is the file's (relative dataset paths
    are resolved from there), ``stem`` its name (the run's when it names none)."""
    out, ctx = Conversion(flavour), Context(source, folder)
    rows = {r.key: r for r in TABLES[flavour]}
    for key, value in source.items():
        row = rows.get(key)
        if row is None:
            out.unknown.append(key)
        elif value in (None, "", [], {}) or (row.field is None and value is False):
            out.empty.append(key)
        else:
            _apply(row, value, ctx, out)
    for dotted, value, why in (("name", run_name(stem), "the file's name"), ("storage", DEFAULT_STORAGE, "the demo's")):
        if dotted not in out.tree:
            _put(out.tree, dotted, value)
            out.mapped.append((f"({why})", dotted, value))
    return out


def _apply(row: Row, value: Any, ctx: Context, out: Conversion) -> None:
    try:
        got = row.how(value, ctx) if row.how is not None else value
        if row.field is None:
            raise Cannot(row.note)
    except Cannot as e:
        out.dropped.append((row.key, str(e)))
        return
    if got is None:
        out.empty.append(row.key)
        return
    fields = got if isinstance(got, Fields) else Fields({row.field: got})
    for dotted, v in fields.values.items():
        _put(out.tree, dotted, v)
        out.mapped.append((row.key, dotted, copy.deepcopy(v)))  # as set (model.lora's {} fills up later)
    out.notes += [(row.key, n) for n in (fields.note, row.note) if n]


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        node[last].update(value)  # ``model.lora: {}`` after ``model.lora.r: 16`` keeps r
    else:
        node[last] = value


def read(path: Path) -> dict[str, Any]:
    """The file's YAML mapping; Unconvertible for a file that is missing, unreadable or not a YAML mapping."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise Unconvertible(f"cannot read {path}: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{path}:{mark.line + 1}" if mark else str(path)
        raise Unconvertible(f"{at}: not valid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(data, dict):
        raise Unconvertible(f"{path}: not a YAML mapping of keys (an Axolotl or TRL config is one)")
    return data


def detect(raw: dict[str, Any], path: Path, flavour: str | None) -> Flavour:
    """The flavour asked for (``--from``), or the one the keys tell; Unconvertible when neither says."""
    if flavour is not None:
        if flavour not in TABLES:
            raise Unconvertible(f"--from {flavour}: unknown; it is one of {', '.join(TABLES)}")
        return flavour
    found = flavour_of(raw)
    if found is None:
        marks = "; ".join(f"{TOOL[f]}: {', '.join(m)}" for f, m in MARKS.items())
        raise Unconvertible(
            f"{path}: cannot tell whose config it is (no keys only one tool has: {marks}); "
            "say it with --from axolotl or --from trl"
        )
    return found
