"""``model``: the base model (a hub id, a folder or a built-in), LoRA, and what weights a run starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ray_jobs.config.base import Section

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-llama",)


class TinyModelConfig(Section):
    hidden_size: int = Field(64, ge=8)
    """Width of the built-in tiny Llama."""
    num_layers: int = Field(2, ge=1)
    """Decoder layers of the built-in tiny Llama."""
    num_heads: int = Field(4, ge=1)
    """Attention heads of the built-in tiny Llama (must divide hidden_size)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width of the built-in tiny Llama."""
    max_position_embeddings: int = Field(1024, ge=8)
    """Longest sequence the built-in tiny Llama accepts, in tokens."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        return self


class LoraConfig(Section):
    r: int = Field(8, ge=1)
    """Rank of the LoRA update matrices."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]
    """Names of the layers that get adapters, or ``all-linear``: every linear layer but the output head."""
    modules_to_save: list[str] = []
    """Modules trained in full next to the adapters (e.g. ``lm_head``, ``embed_tokens``); merged into the export."""


class ModelConfig(Section):
    name_or_path: str = "builtin:tiny-llama"
    """Base model: a Hugging Face hub id, a local/fsspec folder saved with save_pretrained, or
    ``builtin:tiny-llama`` (a tiny Llama built from ``model.tiny`` with a locally trained tokenizer; no network)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the built-in tiny model; ignored for any other ``name_or_path``."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) instead of all weights; the final export is merged into a plain HF model."""
    quantization: Literal["none", "4bit"] = "none"
    """``4bit``: QLoRA -- the frozen base is loaded in 4-bit NF4 with double quantization (bitsandbytes; computed in
    bf16 where training runs in bf16, else fp32) and only ``model.lora``'s adapters train on it, in fp32. Needs
    ``model.lora`` and the ``bitsandbytes`` package on the workers (``pip install 'unbroken[qlora]'``); runs on CUDA
    and on CPU. Checkpoints hold the adapters alone (the base is quantized again, the same way, on a resume); the
    export merges them into the base loaded unquantized (or writes them alone: ``train.export: adapter``)."""
    init_from: Literal["base", "series-champion", "series-latest"] = "base"
    """Weights a run starts from: ``base`` = ``name_or_path``; ``series-champion`` / ``series-latest`` = the final
    model of the series' champion / newest succeeded run (warm start; falls back to ``base``, logged, when the
    series has none yet). Tokenization always follows ``name_or_path``: a warm start changes weights, not data."""

    @field_validator("name_or_path")
    @classmethod
    def _known_builtin(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        if v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {v!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
        return v
