"""The model a worker trains: the base model loaded, optionally LoRA-wrapped, then DDP-prepared or FSDP-sharded;
and the model rank 0 exports at the end."""

from __future__ import annotations

import contextlib
from typing import Protocol

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config
from ray_jobs.config.methods import METHODS
from ray_jobs.contracts.checkpoint import StateDict
from ray_jobs.model.loading import (
    config_dict,
    load_model_fp32,
    load_reward_model_fp32,
    quantized_loading,
    saved_dtype,
)
from ray_jobs.model.lora import check_lora, ties_embeddings


class Placement(Protocol):
    """What building the model needs of a :class:`~ray_jobs.train.runtime.Runtime`: its device, and how a model is
    wrapped (DDP) or sharded (FSDP) there."""

    def device(self): ...

    def prepare_model(self, model): ...

    def shard_model(self, model): ...


def build_model(cfg: Config, model_path: str, rt: Placement):
    device = rt.device()
    loading = quantized_loading(cfg.model.quantization, device, bf16_training(cfg, device))
    if trains_reward_head(cfg):  # the base's weights under a new scalar head, drawn from train.seed
        model = load_reward_model_fp32(model_path, cfg.data.cache_dir, cfg.train.seed, **loading)
    else:
        model = load_model_fp32(model_path, cfg.data.cache_dir, **loading)
    if cfg.train.gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # torch.utils.checkpoint, non-reentrant
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    fsdp = cfg.train.parallelism == "fsdp"
    model = rt.shard_model(model) if fsdp else rt.prepare_model(model.to(rt.device()))
    if cfg.train.compile:
        model.compile()  # nn.Module.compile: in place, so state_dict keys (and checkpoints) are unchanged
    return model


def trains_reward_head(cfg: Config) -> bool:
    """Whether the run trains a reward model (``train.method: reward``: a scalar head on the base, no LM head; its
    export a sequence-classification folder, which does not generate). ``auto`` never does."""
    return cfg.train.method != "auto" and METHODS[cfg.train.method].reward_head


def apply_lora(model, cfg: Config):
    """Wrap ``model`` in peft LoRA adapters; a config that does not fit the model is a ValueError naming the field
    (the flow checks this before any cluster work; this catches a job submitted without it)."""
    from peft import LoraConfig, get_peft_model

    lc = cfg.model.lora
    assert lc is not None, "callers apply LoRA only when model.lora is set"
    check_lora(model, lc, cfg.model.name_or_path)
    if getattr(model, "is_loaded_in_4bit", False):  # peft's own preparation of a k-bit base: frozen, norms in fp32
        from peft import prepare_model_for_kbit_training

        # (gradient checkpointing is build_model's, with its own arguments)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        _one_cpu_weight_format(model)
    targets = lc.target_modules if isinstance(lc.target_modules, str) else list(lc.target_modules)
    return get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,  # ty: ignore[invalid-argument-type]  # peft annotates int; it computes alpha / r
            lora_dropout=lc.dropout,
            target_modules=targets,
            modules_to_save=list(lc.modules_to_save) or None,  # a copy: peft edits this list in place
            ensure_weight_tying=_needs_tying(model, lc.modules_to_save),
            task_type="CAUSAL_LM",
        ),
    )


def _one_cpu_weight_format(model) -> None:
    """Keep each 4-bit weight in the one format it was quantized to. On a CPU with AVX512-BF16, bitsandbytes 0.50
    repacks a ``Linear4bit`` weight for its CPU kernel at the first forward without gradients (an eval) and unpacks it
    whenever a state dict is taken (each checkpoint) -- not back to the quant state it had: the steps after a
    checkpoint then compute (in the last bits) unlike the same steps of a run resumed from it, and a resume is no
    longer exact. The switch is the layer's own attribute; on a GPU the path is never taken."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def _needs_tying(model, modules_to_save: list[str]) -> bool:
    """Whether peft must keep a tied head tied: without ``ensure_weight_tying``, peft 0.21 trains a separate copy
    of a tied ``lm_head`` listed in modules_to_save, and the merged export silently comes out untied
    (``tie_word_embeddings=False``, a second vocab x hidden matrix). (Adapters on a tied layer are refused by
    :func:`check_lora`.) Asked only when needed: peft warns when it finds nothing to tie."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    return ties_embeddings(model) and any(n.rsplit(".", 1)[-1] in EMBEDDING_LAYER_NAMES for n in modules_to_save)


def export_model(cfg: Config, model_path: str, state: StateDict):
    """The final model as a plain HF model in ``train.export_dtype`` built from a full state dict: the base model
    (unquantized) with the trained weights (LoRA merged in). Only FSDP + LoRA and a 4-bit base need this (a second
    model instance: adapters merged into 4-bit weights would be rounded back to 4 bits, and a 4-bit model cannot be
    cast to the export dtype); every other run exports its trained model in place (:func:`finish_in_place`,
    :func:`write_sharded_export`)."""
    model = load_model_fp32(model_path, cfg.data.cache_dir)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
        ckpt.load_model_state(model, state, fsdp=False, trainable_only=True)
    else:
        ckpt.load_model_state(model, state, fsdp=False, trainable_only=False)
    return finish_in_place(cfg, model_path, model)


def finish_in_place(cfg: Config, model_path: str, model):
    """The trained model itself made the export: LoRA merged into its layers (peft merges layer by layer), cast to
    ``train.export_dtype`` parameter by parameter -- no second copy of the model. Tied embeddings stay tied. With
    ``train.export: adapter`` the PeftModel itself, whose ``save_pretrained`` writes the adapters alone, its config
    naming the base model where this run loaded it (``model_path``: what ``load_model`` opens it with)."""
    import torch

    if cfg.train.export == "adapter":
        model.peft_config["default"].base_model_name_or_path = model_path
        return model.to(getattr(torch, export_dtype(cfg, model_path)))
    tied = ties_embeddings(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if cfg.model.lora is not None:
        model = model.merge_and_unload()
    if tied and not ties_embeddings(model):
        raise RuntimeError("the merged model lost its tied input/output embeddings; refusing to export it untied")
    _inference_config(model, model_path)
    return model.to(getattr(torch, export_dtype(cfg, model_path)))


def _inference_config(model, model_path: str) -> None:
    """Undo what training set on the config for itself: gradient checkpointing turns the KV cache off."""
    model.config.use_cache = config_dict(model_path).get("use_cache", True)


def write_sharded_export(cfg: Config, model_path: str, model, rank: int, folder: str) -> None:
    """An FSDP model's weights as HF sharded safetensors, gathered one tensor at a time (every rank takes part in
    each gather; rank 0 writes a file each time ``train.export_shard_mb`` fills): memory holds one file's worth,
    never the whole model. What ``save_pretrained(max_shard_size=...)`` writes, without the full state dict."""
    import torch

    dtype = getattr(torch, export_dtype(cfg, model_path))
    state = model.state_dict()
    names = [n for n in state if n not in ckpt.tied_aliases(model)]
    plan = plan_export_files({n: state[n].numel() * dtype.itemsize for n in names}, cfg.train.export_shard_mb)
    for name, group in plan.filename_to_tensors.items():  # the same plan, in the same order, on every rank
        _write_export_file(state, group, dtype, rank, f"{folder}/{name}")
    if rank == 0:
        _write_export_config(model, model_path, dtype, plan, folder)


def plan_export_files(sizes: dict[str, int], shard_mb: float):
    """Tensors in order into files of at most ``shard_mb`` MB, named and indexed as ``save_pretrained`` does (the
    planner it uses: ``huggingface_hub``'s), from their sizes in bytes alone: no tensor is gathered to plan."""
    from huggingface_hub import split_state_dict_into_shards_factory

    # An integer byte count L exceeds shard_mb * 1e6 exactly when it exceeds its floor: the cut is the same.
    return split_state_dict_into_shards_factory(
        sizes,
        get_storage_size=lambda size: size,
        get_storage_id=lambda size: None,  # tied aliases are left out
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=int(shard_mb * 1e6),
    )


def _write_export_file(state: StateDict, names: list[str], dtype, rank: int, path: str) -> None:
    """Gather each tensor of one file (a collective: every rank calls this), rank 0 writing the file."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    tensors = {}
    for n in names:
        t = state[n].full_tensor() if isinstance(state[n], DTensor) else state[n]
        if rank == 0:
            tensors[n] = t.detach().to("cpu", dtype).contiguous()
    if rank == 0:
        save_file(tensors, path, metadata={"format": "pt"})


def _write_export_config(model, model_path: str, dtype, plan, folder: str) -> None:
    """The index of a sharded export (as ``save_pretrained`` writes it), the model's config and generation config."""
    import json

    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        with open(f"{folder}/model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    model.config.dtype = dtype
    _inference_config(model, model_path)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def export_dtype(cfg: Config, model_path: str) -> str:
    """``train.export_dtype``, with ``auto`` resolved to the dtype the base model was saved in."""
    if cfg.train.export_dtype != "auto":
        return cfg.train.export_dtype
    return saved_dtype(config_dict(model_path))


def build_optimizer(cfg: Config, model, device):
    """AdamW over the trainable parameters and its LR schedule."""
    import torch
    from transformers import get_scheduler

    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    # On a GPU the fused AdamW (one kernel for every parameter's update, fp32 moments as the parameters); on a
    # CPU the default, whose bits the CPU resume guarantees were shown with.
    fused = True if device.type == "cuda" else None  # None: torch's default, as when it is not passed
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=fused)
    return optimizer, get_scheduler(t.lr_schedule, optimizer, t.warmup_steps, t.max_steps)


def bf16_training(cfg: Config, device) -> bool:
    """Whether training computes in bf16: ``train.precision`` bf16, or ``auto`` on a GPU."""
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")


def autocast_for(cfg: Config, device):
    """A context factory: bf16 autocast where ``train.precision`` asks for it (``auto``: on a GPU), else nothing."""
    import torch

    bf16 = bf16_training(cfg, device)
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext


def to_device(x, device):
    """A batch array on the training device: on a GPU through pinned memory, asynchronously (a copy from pageable
    memory synchronizes the stream first: the GPU would idle at every micro-batch)."""
    import torch

    t = torch.from_numpy(x)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def grad_sync(model, fsdp: bool, sync: bool):
    """Gradients are all-reduced only on the last micro-batch of an accumulation."""
    if fsdp:
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def micro_loss(model, ids, labels, pos, learned: bool = True):
    """The model's loss on one micro-batch (use_cache=False: transformers ignores packed position_ids while it
    builds a KV cache). A micro-batch wholly past ``train.epochs``' last pass has no label to take a mean of: its
    loss is a zero that still reaches every parameter, so each rank's backward syncs the same gradients."""
    out = model(input_ids=ids, labels=labels if learned else None, position_ids=pos, use_cache=False)
    return out.loss if learned else out.logits.sum() * 0.0


def clip_grads(model, max_grad_norm: float):
    """Clip the global gradient norm (0: no clipping); the norm, a device tensor (reading it would wait)."""
    import torch

    max_norm = max_grad_norm or float("inf")
    params = [p for p in model.parameters() if p.requires_grad]
    return global_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))


def global_norm(norm):
    """A gradient norm ``clip_grad_norm_`` returned, as a plain tensor: over FSDP2's DTensor gradients it is a
    DTensor (the global norm, replicated on every rank)."""
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm
