"""``train.method``: what a run optimizes, as data -- one row per training method, read by the config's checks, the
``hf`` engine (which TRL or transformers trainer computes the steps, which arguments class ``train.hf_args`` is
checked against, which of its metrics are logged), staging (one record a row, or packed) and ``unbroken check``'s
memory plan, instead of branches on the method's name.

A new method is one row here (its name in ``MethodName``, which a test holds to the rows) and, when its records are
of a new kind, the batch its trainer takes (``ray_jobs/train/trl_methods.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

MethodName = Literal["auto", "sft", "trl_sft", "dpo", "kto", "reward", "grpo"]

# What a method's records are (``RecordFormat``'s kinds): packed prompt/completion rows, preference pairs, unpaired
# labelled completions (KTO's), or prompts alone (the completion, when a record has one, is the reward's ``answer``).
Records = Literal["rows", "pairs", "unpaired", "prompts"]


@dataclass(frozen=True)
class Method:
    """One ``train.method``."""

    name: str
    trainer: str  # "module:Class" of the trainer computing each step under the hf engine
    args: str  # "module:Class" of its arguments (``train.hf_args`` is checked against its fields)
    records: Records
    what: str  # a line for docs and `check`
    native: bool = False  # the native engine runs it (its own loop's loss: next-token cross-entropy)
    reference: bool = False  # keeps a frozen reference model beside the policy (a full fine-tune holds a copy)
    generates: bool = False  # samples completions every step (``unbroken check`` plans their buffers)
    rewards: bool = False  # reads ``train.rewards`` (functions scoring the completions)
    reward_head: bool = False  # trains a scalar head (a sequence-classification model) rather than the LM head
    # its own eval (``ray_jobs/train/trl_methods.py``: the method's loss on the held-out records) logs this column of
    # its metrics beside the loss, as ``eval_<column>``; "": the native eval (mean loss per target token)
    eval_metric: str = ""
    # TRL metric name (or prefix, ending in "/") -> the metrics-log column, averaged over a logged step's values
    metrics: Mapping[str, str] = field(default_factory=dict, compare=False)


ROWS: tuple[Method, ...] = (
    Method("sft", "transformers:Trainer", "transformers:TrainingArguments", "rows", "next-token cross-entropy on the completions", native=True),
    Method("trl_sft", "trl:SFTTrainer", "trl:SFTConfig", "rows", "TRL's SFTTrainer: the same loss, its token accuracy and entropy logged", metrics={"mean_token_accuracy": "token_accuracy", "entropy": "entropy"}),
    Method("dpo", "trl:DPOTrainer", "trl:DPOConfig", "pairs", "DPO on preference pairs against the base model", reference=True, eval_metric="reward_accuracy", metrics={"rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin"}),
    Method("kto", "trl:KTOTrainer", "trl:KTOConfig", "unpaired", "KTO on completions labelled desirable or not, against the base model", reference=True, eval_metric="reward_margin", metrics={"rewards/chosen": "reward_chosen", "rewards/rejected": "reward_rejected", "rewards/margins": "reward_margin", "kl": "kl"}),
    Method("reward", "trl:RewardTrainer", "trl:RewardConfig", "pairs", "a reward model: a scalar head scoring the chosen answer over the rejected", reward_head=True, eval_metric="reward_accuracy", metrics={"accuracy": "reward_accuracy", "margin": "reward_margin"}),
    Method("grpo", "trl:GRPOTrainer", "trl:GRPOConfig", "prompts", "GRPO: completions sampled per prompt, scored by train.rewards, their group advantages", generates=True, rewards=True, metrics={"reward": "reward", "reward_std": "reward_std", "rewards/": "reward_", "completions/mean_length": "completion_length", "kl": "kl", "entropy": "entropy"}),
)  # fmt: skip
METHODS: dict[str, Method] = {m.name: m for m in ROWS}


def method_of(method: str, pairs: bool) -> Method:
    """The method that runs: ``train.method``'s, or for ``auto`` DPO on preference pairs and SFT on anything else."""
    if method == "auto":
        return METHODS["dpo" if pairs else "sft"]
    return METHODS[method]


def prompts_only(method: str) -> bool:
    """Whether ``train.method`` trains on prompts alone (staged one a row, a chat's final reply as the answer)."""
    return method != "auto" and METHODS[method].records == "prompts"


def load_class(dotted: str) -> Any:
    """The class a row names as ``module:Class`` (imported where it is needed: transformers and TRL are heavy)."""
    import importlib

    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def column_of(method: Method, metric: str) -> str | None:
    """The metrics-log column of one of the trainer's metrics (``rewards/correct/mean`` -> ``reward_correct``), or
    None when it is not logged."""
    if metric in method.metrics:
        return method.metrics[metric]
    for prefix, column in method.metrics.items():
        if prefix.endswith("/") and metric.startswith(prefix) and metric.endswith("/mean"):
            return column + metric[len(prefix) : -len("/mean")]
    return None


def records_of(fmt: Any) -> Records | None:
    """What a record format's records are (a ``RecordFormat``), as a method reads them; None for ``auto`` (known
    once the first records are read)."""
    if fmt.detected:
        return None
    if fmt.pairs:
        return "pairs"
    return "unpaired" if getattr(fmt, "labelled", False) else "rows"


def method_problems(cfg: Any) -> list[str]:
    """Why ``train.method`` cannot run this config: its engine, its records' shape, its rewards."""
    from ray_jobs.config.record_formats import record_format

    t, fmt = cfg.train, record_format(cfg.data.format)
    records = records_of(fmt)
    method = method_of(t.method, records == "pairs")
    problems = []
    if not method.native and t.engine != "hf":
        problems.append(f"train.method: {method.name} is computed by {method.trainer} and needs train.engine=hf")
    if records is not None and not reads(method, records, fmt.documents):
        are = "documents" if fmt.documents else READS[records]
        problems.append(
            f"train.method: {method.name} trains on {READS[method.records]}; data.format={fmt.name} are {are}"
        )
    if method.rewards and not t.rewards:
        problems.append(
            f"train.rewards: train.method={method.name} scores its completions by reward functions; name at least "
            "one (module:function)"
        )
    if t.rewards and not method.rewards:
        problems.append(f"train.rewards: only read by train.method=grpo (this run's method is {method.name})")
    if method.generates and t.epochs is not None:
        problems.append(f"train.epochs: not with train.method={method.name} yet (set train.max_steps)")
    if method.name == "kto" and t.micro_batch_size < 2 and t.hf_args.get("loss_type") != "apo_zero_unpaired":
        problems.append(
            "train.micro_batch_size: train.method=kto estimates its KL term from the other completions of each "
            "micro-batch: set 2 or more"
        )
    if method.reward_head and cfg.model.lora is not None:
        problems.append("model.lora: train.method=reward trains a new scalar head: not with LoRA adapters yet")
    return problems


READS: dict[str, str] = {
    "rows": "prompt/completion records (any format but preference pairs)",
    "pairs": "preference pairs (data.format: preference)",
    "unpaired": "labelled completions (data.format: unpaired_preference)",
    "prompts": "prompts (any prompt/completion or chat format: the completion, if any, is the rewards' answer)",
}


def reads(method: Method, records: str, documents: bool = False) -> bool:
    """Whether ``method`` trains on records of this kind."""
    if method.records == "prompts":
        return records == "rows" and not documents
    return method.records == records
