"""A LoRA config checked against a model's module tree, before any weight is loaded.

peft itself accepts a ``modules_to_save`` name that matches nothing (it trains nothing extra, silently) and names
a missing target only once the job has loaded the model on the cluster; both are config mistakes, so they are
reported like any other bad field, naming it.
"""

from __future__ import annotations

from ray_jobs.config import ConfigError, LoraConfig

ALL_LINEAR = "all-linear"


def linear_layers(model) -> dict[str, str]:
    """Full name -> short name (``model.layers.0.self_attn.q_proj`` -> ``q_proj``) of every linear layer,
    counted the way peft's ``all-linear`` counts them (``nn.Linear`` and GPT-2 style ``Conv1D``)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return {n: n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | Conv1D)}


def all_linear_targets(model) -> list[str]:
    """What ``all-linear`` adapts: every linear layer but the output head (peft 0.21 leaves the head out)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n in linear_layers(model) if model.get_submodule(n) is not head]


def targeted(model, targets: list[str] | str) -> list[str]:
    """Full names of the layers ``targets`` (``model.lora.target_modules``) adapts."""
    if targets == ALL_LINEAR:
        return all_linear_targets(model)
    return [n for n in linear_layers(model) if any(_targets(t, n) for t in targets)]


def lora_problems(model, lora: LoraConfig, model_name: str) -> list[str]:
    """Every way ``lora`` does not fit ``model``'s module tree, one message per problem, naming the field."""
    where = f"{model_name} ({type(model).__name__})"
    return _target_problems(model, lora.target_modules, where) + _save_problems(model, lora.modules_to_save, where)


def _target_problems(model, targets: list[str] | str, where: str) -> list[str]:
    if targets == ALL_LINEAR:
        if all_linear_targets(model):
            return []
        return [f"model.lora.target_modules: all-linear found no linear layers in {where} besides its head"]
    names = [n for n, _ in model.named_modules() if n]
    problems = []
    tied = [t for t in targets if any(_targets(t, n) for n in tied_layer_names(model))]
    if tied:
        # Verified on SmolLM2: the tied adapters' delta lands in the shared matrix once per layer (W0 + 2 delta).
        problems.append(
            f"model.lora.target_modules: {', '.join(tied)} shares its weight with the tied input/output embedding "
            f"of {where}; peft 0.21 merges such an adapter into that one matrix twice, so the export would not be "
            "the trained model. Train the matrix in full instead: model.lora.modules_to_save: [lm_head]"
        )
    missing = [t for t in targets if not any(_targets(t, n) for n in names)]
    if missing:
        shorts = ", ".join(dict.fromkeys(linear_layers(model).values())) or "(none)"
        problems.append(
            f"model.lora.target_modules: {', '.join(missing)} not found in {where}; its linear layers are: {shorts}"
        )
    return problems


def _save_problems(model, modules_to_save: list[str], where: str) -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    # peft's rule for modules_to_save is a plain suffix match on the module name.
    unsaved = [m for m in modules_to_save if not any(n.endswith(m) for n in names)]
    if not unsaved:
        return []
    # The candidates worth naming live outside the repeated blocks (embed_tokens, norm, lm_head, ...).
    singles = [n.rsplit(".", 1)[-1] for n in names if not any(p.isdigit() for p in n.split("."))]
    return [
        f"model.lora.modules_to_save: {', '.join(unsaved)} not found in {where}; "
        f"its modules outside the repeated layers are: {', '.join(dict.fromkeys(singles))}"
    ]


def _targets(target: str, name: str) -> bool:
    """peft's rule for a list of targets: a module is targeted when its name is the entry or ends with "." + it."""
    return name == target or name.endswith(f".{target}")


def tied_layer_names(model) -> list[str]:
    """Full names of the input embedding and the output head when they share one weight, else nothing."""
    if not ties_embeddings(model):
        return []
    layers = (model.get_input_embeddings(), model.get_output_embeddings())
    return [n for n, m in model.named_modules() if any(m is layer for layer in layers)]


def check_lora(model, lora: LoraConfig, model_name: str) -> None:
    """Raise a ConfigError (a ValueError) listing every problem of ``lora`` on ``model``, if any."""
    problems = lora_problems(model, lora, model_name)
    if problems:
        raise ConfigError(problems)


def ties_embeddings(model) -> bool:
    """Whether the output head shares its weight with the input embedding (SmolLM2, Llama-3.2, Gemma...)."""
    if not hasattr(model, "get_input_embeddings"):
        return False
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight
