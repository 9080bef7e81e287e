"""Loading a base model and its tokenizer from a hub id, a local folder, or a folder on shared storage."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from ray_jobs.model.cache import cached_folder
from ray_jobs.storage import is_local, join, read_json

if TYPE_CHECKING:  # transformers is imported when a model is loaded
    from transformers import BitsAndBytesConfig

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_CONFIG = "adapter_config.json"  # what marks a PEFT adapter folder


def local_folder(name_or_path: str, cache_root: str | Path) -> str:
    """Return something ``from_pretrained`` can open: a local folder, a hub id, or a storage folder's verified copy in
    the node's model cache (``<cache_root>/models/``, downloaded once per node: ray_jobs/model/cache.py)."""
    if is_local(name_or_path) or not _looks_like_url(name_or_path):
        return name_or_path.removeprefix("file://")
    return str(cached_folder(name_or_path, cache_root))


def _looks_like_url(s: str) -> bool:
    return "://" in s


def load_tokenizer(name_or_path: str, cache_root: str | Path | None = None):
    from transformers import AutoTokenizer

    root = cache_root or tempfile.gettempdir()
    return AutoTokenizer.from_pretrained(local_folder(name_or_path, root))


def load_model(name_or_path: str, cache_root: str | Path | None = None, **kwargs):
    """The model in a folder (or hub id); an adapter folder (``train.export: adapter``) is its base model with the
    adapters merged in, so a report, a warm start or a test opens either kind of final folder the same way."""
    from transformers import AutoModelForCausalLM

    root = cache_root or tempfile.gettempdir()
    if (base := adapter_base(name_or_path)) is not None:
        from peft import PeftModel

        model = load_model(base, root, **kwargs)
        return PeftModel.from_pretrained(model, local_folder(name_or_path, root)).merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(local_folder(name_or_path, root), **kwargs)


def adapter_base(name_or_path: str) -> str | None:
    """The base model an adapter folder was trained on (its ``adapter_config.json``'s ``base_model_name_or_path``:
    unbroken writes the base model's location the run loaded), None for a plain model folder or a hub id."""
    if not _looks_like_url(name_or_path):  # a local folder, or a hub id (no adapter folders there)
        path = Path(name_or_path) / ADAPTER_CONFIG
        return json.loads(path.read_text())["base_model_name_or_path"] if path.is_file() else None
    try:
        return read_json(join(name_or_path, ADAPTER_CONFIG))["base_model_name_or_path"]
    except FileNotFoundError:
        return None


def load_model_fp32(name_or_path: str, cache_root: str | Path | None = None, **kwargs):
    """The base model with fp32 weights whatever dtype it was saved in: the master weights training updates
    (transformers 5 defaults to ``dtype="auto"``, which would train a bf16 checkpoint as bf16 weights). ``kwargs``:
    more ``from_pretrained`` arguments (a 4-bit base's, :func:`quantized_loading`)."""
    import torch

    return load_model(name_or_path, cache_root, dtype=torch.float32, **kwargs)


def load_reward_model_fp32(name_or_path: str, cache_root: str | Path | None = None, seed: int = 0, **kwargs):
    """The base model's weights, fp32, under a new scalar head: ``AutoModelForSequenceClassification`` with one
    label (a reward model: ``train.method: reward``; a causal LM's folder loads as its ``...ForSequenceClassification``,
    the LM head left out). The head -- the weights the folder lacks -- is drawn from ``seed`` alone, by a generator
    of its own (normal, the config's ``initializer_range``; biases zero), so two runs of one seed start alike whatever
    the global RNG has drawn. The config names the new class (``architectures``), so an export of it, however it is
    written, loads as a reward model."""
    import torch
    from transformers import AutoModelForSequenceClassification

    folder = local_folder(name_or_path, cache_root or tempfile.gettempdir())
    model, info = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=1, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in info["missing_keys"]:
                drawn = torch.randn(p.shape, generator=generator) * std if p.dim() > 1 else torch.zeros(p.shape)
                p.copy_(drawn.to(p.dtype))
    model.config.architectures = [type(model).__name__]
    return model


class QuantizedLoading(TypedDict, total=False):
    """What ``from_pretrained`` is given to load a quantized base."""

    quantization_config: BitsAndBytesConfig
    device_map: dict[str, str]


def quantized_loading(quantization: str, device, bf16: bool) -> QuantizedLoading:
    """``from_pretrained``'s arguments for ``model.quantization`` (``none``: none). ``4bit``: QLoRA's recipe
    (bitsandbytes NF4, double quantization), computed in bf16 when training runs in bf16, else fp32; the weights are
    quantized as they load, onto ``device`` (bitsandbytes quantizes on the device that holds them)."""
    if quantization == "none":
        return {}
    import torch
    from transformers import BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    return {"quantization_config": q, "device_map": {"": str(device)}}


def forgo_bitsandbytes(quantization: str) -> bool:
    """In a process of its own that trains a run without ``model.quantization``, make bitsandbytes look absent to
    every library, as if it were not installed (``sys.modules`` holding None: ``import`` raises ImportError and
    ``importlib.util.find_spec`` answers None). peft and TRL import it at their own import whenever it is installed
    (``pip install 'unbroken[qlora]'``), which costs each such process ~1.2 CPU-s and, on CPU, a warning line about
    kernels it cannot load, for a package only a quantized base uses. Only for a process that is the run's alone (a
    Ray Train worker, a torchrun rank): it cannot import bitsandbytes afterwards. Already imported: left as it is.
    Returns whether it is now hidden."""
    import sys

    if quantization == "none" and "bitsandbytes" not in sys.modules:
        # typeshed types sys.modules as dict[str, ModuleType]; None there is Python's documented import blocker
        sys.modules["bitsandbytes"] = None  # ty: ignore[invalid-assignment]
    return "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None


# A model's ``config.json`` as saved: architecture-specific fields, read by key and narrowed where used
ModelConfigJson = dict[str, object]


def config_dict(name_or_path: str) -> ModelConfigJson:
    """The model's ``config.json`` as saved, without loading weights (or copying them off storage); an adapter
    folder's is its base model's."""
    if (base := adapter_base(name_or_path)) is not None:
        return config_dict(base)
    if _looks_like_url(name_or_path) and not is_local(name_or_path):
        return read_json(join(name_or_path, "config.json"))
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(name_or_path.removeprefix("file://"))[0]


def saved_dtype(config: ModelConfigJson) -> str:
    """The dtype a model was saved in, from its config dict (``dtype`` since transformers 5, ``torch_dtype``
    before); float32 when it is missing or not one we export."""
    raw = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return raw if raw in EXPORT_DTYPES else "float32"


def meta_model(name_or_path: str):
    """The model's module tree on the meta device: its layer names and types, no weights read, no memory used."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(config_dict(name_or_path))
    config = AutoConfig.for_model(str(raw.pop("model_type")), **raw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
