"""Model FLOPs utilisation: what a trained token costs the model, and what this process's GPU can do at its peak.

MFU = tokens/s x FLOPs per token / (peak FLOP/s of one GPU x GPUs). FLOPs per token is torchtitan's count (the GPU
kit's too, bench/gpu/kit.py): 6 x the parameters of every linear layer (the output head included, the embedding
lookup being no matmul) + 12 x layers x hidden size x sequence length (attention). The peak is the card's dense bf16
figure from NVIDIA's datasheets (SXM parts), known for the cards below; on any other device there is no MFU.
"""

from __future__ import annotations

from typing import Any

# Dense bf16 peak of the card, FLOP/s, by a name torch.cuda.get_device_name() contains (H200 has H100's compute).
SPEC_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12}


def gpu_peak_flops() -> float | None:
    """This process's CUDA device's spec peak; None without CUDA or for a card not in ``SPEC_PEAK``."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in SPEC_PEAK.items() if k in name), None)


def flops_per_token(model: Any, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward and backward) of ``model`` (wrapped or not: DDP, FSDP, peft) at
    ``seq_len``."""
    import torch

    seen: set[int] = set()
    matmul = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None and id(weight) not in seen:
            seen.add(id(weight))
            matmul += weight.numel()  # a DTensor (FSDP2) counts its whole shape
    config = _hf_config(model)
    layers, hidden = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    return 6.0 * matmul + 12.0 * layers * hidden * seq_len


def _hf_config(model: Any) -> Any:
    """The Hugging Face config under any wrapper (``.module`` of DDP, ``.base_model.model`` of peft)."""
    for _ in range(4):
        if hasattr(model, "config") and hasattr(model.config, "num_hidden_layers"):
            return model.config
        model = getattr(model, "module", None) or getattr(model, "base_model", None) or getattr(model, "model", None)
        if model is None:
            break
    return None
