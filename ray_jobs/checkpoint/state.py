"""What a checkpoint captures of a live run: loop state, per-rank cursors and RNG streams, model and optimizer state
(DDP or FSDP), and how it is put back."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

from ray_jobs.checkpoint.format import MODEL_FILE, OPTIM_FILE, CheckpointInvalid, decode, model_part, optim_part
from ray_jobs.checkpoint.rng import rng_state
from ray_jobs.contracts.checkpoint import CheckpointManifest, CursorDict, LoopDict, RankPart, StateDict, StateFile
from ray_jobs.data.reading import Cursor
from ray_jobs.secrets import mask_tree

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class LoopState:
    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    best_eval_loss: float | None = None
    world_size: int = 1
    dataset_id: str = ""


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def rank_state(cursor: Cursor) -> RankPart:
    """This rank's ``rank-<r>.json``: its data rank's cursor and its RNG streams."""
    return {"cursor": {"epoch": cursor.epoch, "pos": cursor.pos}, "rng": rng_state()}


# -- model / optimizer state (DDP or FSDP) --------------------------------------------------------------------
def trainable_names(model) -> set[str]:
    return {n for n, p in unwrap(model).named_parameters() if p.requires_grad}


def tied_aliases(model) -> dict[str, str]:
    """Names that share one tensor with an earlier name (tied embeddings: ``lm_head.weight`` ->
    ``model.embed_tokens.weight``), as alias -> the name the checkpoint stores."""
    from itertools import chain

    m = unwrap(model)
    first: dict[int, str] = {}
    aliases = {}
    for name, t in chain(m.named_parameters(remove_duplicate=False), m.named_buffers(remove_duplicate=False)):
        source = first.setdefault(id(t), name)
        if source != name:
            aliases[name] = source
    return aliases


class HostStaging:
    """Host buffers a checkpoint's tensors are copied into, kept from one checkpoint to the next (as DCP's async
    staging does): the copy then writes into memory that is already mapped instead of allocating and faulting in
    a fresh copy of the model each time. Safe because a checkpoint is taken only after the previous write finished
    (:class:`AsyncWriter` holds one write at a time and the trainer collects it first).

    From a GPU the buffers are pinned and the copies asynchronous: the training thread only queues them (a copy into
    pageable memory waits for the device first, tensor by tensor); they run on the training stream before the next
    step's kernels, so they read this step's values, and whoever reads the buffers waits on :meth:`ready`'s event."""

    def __init__(self):
        self._buffers: dict[str, Tensor] = {}
        self._queued = False  # device-to-host copies issued since the last ready()

    def __call__(self, key: str, t) -> Any:
        import torch

        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if not t.is_cuda:
                buf = self._buffers[key] = t.to("cpu", copy=True).contiguous()
                return buf
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if t.is_cuda:
            self._queued = True
            return buf.copy_(t, non_blocking=True)
        return buf.copy_(t)

    def ready(self) -> Callable[[], None] | None:
        """What a reader of the buffers calls first: waits for the copies queued since the last call (None: none)."""
        if not self._queued:
            return None
        import torch

        self._queued = False
        event = torch.cuda.Event()
        event.record()
        return event.synchronize


def _fresh(key: str, t) -> Any:
    return t.detach().to("cpu", copy=True).contiguous()


def model_state(model, fsdp: bool, trainable_only: bool, stage=_fresh) -> StateDict:
    """A CPU copy of the weights (complete on rank 0; under FSDP a collective every rank must join). A tied tensor
    is stored once (safetensors refuses shared tensors, and a copy each would double the embedding's size)."""
    aliases = tied_aliases(model)
    keep = trainable_names(model) if trainable_only else None
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # torch types any state dict's values as ValueType (tensors, numbers, strings, nested); a model's are tensors
        sd = cast("dict[str, Tensor]", get_model_state_dict(model, options=options))
    else:
        sd = unwrap(model).state_dict()
    sd = {k: v for k, v in sd.items() if k not in aliases and (keep is None or k in keep)}
    if not fsdp:  # FSDP's full state dict is already a host copy
        sd = {k: stage(k, v) for k, v in sd.items()}
    return {k: v.contiguous() for k, v in sd.items()}


def optimizer_state(model, optimizer, fsdp: bool, stage=_fresh) -> StateDict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return _cpu_copy(optimizer.state_dict(), stage)


def _cpu_copy(obj, stage=_fresh, key: str = "optim"):
    import torch

    if isinstance(obj, torch.Tensor):
        return stage(key, obj)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v, stage, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v, stage, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


def load_model_state(model, sd: StateDict, fsdp: bool, trainable_only: bool) -> None:
    """Put weights back; a tied alias takes its source's tensor, so strict loading still names missing weights."""
    expected = trainable_names(model) if trainable_only else None
    if expected is not None and set(sd) != expected:
        raise CheckpointInvalid(f"checkpoint weights {sorted(set(sd) ^ expected)[:5]} do not match the model")
    if fsdp:
        import torch

        params = dict(model.named_parameters())
        missing = set(params) - set(sd) if not trainable_only else set()
        if missing:
            raise CheckpointInvalid(f"checkpoint lacks weights {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, full in sd.items():
                if name in params:
                    params[name].copy_(_local_shard(full, params[name]))
    else:
        sd = sd | {a: sd[src] for a, src in tied_aliases(model).items() if src in sd and a not in sd}
        unwrap(model).load_state_dict(sd, strict=not trainable_only)


def _local_shard(full, like):
    """This rank's piece of a full tensor, cut locally (every rank holds the full tensor: no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def load_optimizer_state(model, optimizer, osd: StateDict, fsdp: bool) -> None:
    if not fsdp:
        optimizer.load_state_dict(osd)
        return
    # The FSDP optimizer state was saved keyed by parameter name with full tensors; rebuild the optimizer's own
    # (index-keyed, sharded) form locally, moment by moment.
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, osd["param_groups"], strict=True):
        ids = []
        for p in group["params"]:
            saved = osd["state"].get(names[id(p)])
            if saved is not None:
                state[index] = {k: _local_shard(v, p) if k != "step" else v for k, v in saved.items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- FSDP, sharded: each rank saves and loads its own shards ---------------------------------------------------
def sharded_model_state(model, trainable_only: bool, stage=_fresh) -> tuple[StateDict, StateDict]:
    """(this rank's local shards, the tensors FSDP does not shard) as CPU copies; no collective, nothing gathered."""
    from torch.distributed.tensor import DTensor

    aliases = tied_aliases(model)
    keep = trainable_names(model) if trainable_only else None
    local, replicated = {}, {}
    for name, t in model.state_dict().items():
        if name in aliases or (keep is not None and name not in keep):
            continue
        if isinstance(t, DTensor):
            local[name] = stage(name, t.to_local())
        else:
            replicated[name] = stage(name, t)
    return local, replicated


def load_sharded_model_state(model, local: StateDict, replicated: StateDict, trainable_only: bool) -> None:
    """Copy this rank's saved shards into its own shards of the weights (the same world size wrote them)."""
    import torch
    from torch.distributed.tensor import DTensor

    targets = {n: t for n, t in model.state_dict().items() if n not in tied_aliases(model)}
    if trainable_only:
        targets = {n: t for n, t in targets.items() if n in trainable_names(model)}
    saved = local | replicated
    if set(saved) != set(targets):
        raise CheckpointInvalid(f"checkpoint weights {sorted(set(saved) ^ set(targets))[:5]} do not match the model")
    with torch.no_grad():
        for name, t in saved.items():
            dst = targets[name].to_local() if isinstance(targets[name], DTensor) else targets[name]
            if dst.shape != t.shape:
                raise CheckpointInvalid(f"{name}: this rank's shard is {tuple(dst.shape)}, saved {tuple(t.shape)}")
            dst.copy_(t)


def sharded_optimizer_state(optimizer, stage=_fresh) -> StateDict:
    """The optimizer's own state with every DTensor replaced by this rank's local piece (CPU copies)."""
    from torch.distributed.tensor import DTensor

    osd = optimizer.state_dict()
    local = {
        i: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in st.items()} for i, st in osd["state"].items()
    }
    return {"state": _cpu_copy(local, stage), "param_groups": osd["param_groups"]}


def load_sharded_optimizer_state(optimizer, saved: StateDict) -> None:
    """Rebuild the optimizer's DTensor state from this rank's saved pieces, on each parameter's mesh and placement."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, st in saved["state"].items():
        p = params[int(i)]
        state[int(i)] = {
            k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) and k != "step"
            else v
            for k, v in st.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


# -- resharding: an FSDP checkpoint resumed at another world size -----------------------------------------------
# FSDP2 shards every parameter (and so every optimizer moment) on dim 0 in ``torch.chunk`` pieces, one per rank, in
# rank order: the full tensor is those pieces concatenated. Each rank rebuilds it from every part and cuts its own
# piece for the new world (no collective); memory holds one full copy of the state while it loads, once.
def _full(pieces: list[Any]) -> Any:
    import torch

    return torch.cat([p for p in pieces if p.numel()], dim=0) if any(p.numel() for p in pieces) else pieces[0]


def load_resharded_model_state(model, parts: list[StateDict], replicated: StateDict, trainable_only: bool) -> None:
    """Load weights saved as ``len(parts)`` ranks' shards into this world's shards."""
    full = {name: _full([p[name] for p in parts]) for name in parts[0]}
    load_model_state(model, full | replicated, True, trainable_only)


def load_resharded_optimizer_state(optimizer, parts: list[StateDict]) -> None:
    """Load optimizer state saved as ``len(parts)`` ranks' pieces (index-keyed) into this world's DTensors."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, first in parts[0]["state"].items():
        p = params[int(i)]
        state[int(i)] = {
            k: _local_shard(_full([part["state"][i][k] for part in parts]), p)
            if isinstance(p, DTensor) and k != "step"
            else v
            for k, v in first.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": parts[0]["param_groups"]})


def loop_state_file(
    loop: LoopState, scheduler, last_eval: float | None, cfg: Any, data_ranks: int, cursors: list[Cursor]
) -> StateFile:
    """``state.json``: everything but tensors that resuming exactly needs (nanochat's ``meta``)."""
    return {
        "loop": cast(LoopDict, asdict(loop)),  # LoopState is the one definition of its fields
        "scheduler": scheduler.state_dict(),
        "last_eval_loss": last_eval,
        "config": mask_tree(json.loads(cfg.model_dump_json())),  # the run's config, never its credentials
        # the global cursor: where every data rank is, so any world size resumes on the same rows
        "data": {"data_ranks": data_ranks, "cursors": [cast(CursorDict, asdict(c)) for c in cursors]},
    }


# -- a rank's tensor files, both ways ---------------------------------------------------------------------------
def tensor_files(
    rank: int, model, optimizer, staging: HostStaging, fsdp: bool, lora: bool
) -> dict[str, tuple[str, StateDict]]:
    """This rank's weights and optimizer state as checkpoint files (host copies, ``{name: (codec, state)}``)."""
    files: dict[str, tuple[str, StateDict]] = {}
    if fsdp:  # each rank its own shards, nothing gathered
        local, replicated = sharded_model_state(model, lora, staging)
        files[model_part(rank)] = ("safetensors", local)
        files[optim_part(rank)] = ("torch", sharded_optimizer_state(optimizer, staging))
        if rank == 0 and replicated:
            files[MODEL_FILE] = ("safetensors", replicated)
    elif rank == 0:  # DDP: the weights and optimizer state are the same on every rank: written once
        files[MODEL_FILE] = ("safetensors", model_state(model, False, lora, staging))
        files[OPTIM_FILE] = ("torch", optimizer_state(model, optimizer, False, staging))
    return files


def load_tensor_files(
    model,
    optimizer,
    files: dict[str, bytes],
    manifest: CheckpointManifest,
    written_by: int,
    rank: int,
    world_size: int,
    fsdp: bool,
    lora: bool,
) -> None:
    """Weights and optimizer state into this rank's model: the replicated state (DDP, format 1), its own FSDP
    shards, or every rank's shards cut to this world's (an FSDP checkpoint of ``written_by`` ranks)."""
    from safetensors.torch import load

    if manifest.format <= 1 or not fsdp:
        model_sd, optim_sd, _ = decode(files)
        load_model_state(model, model_sd, fsdp, lora)
        load_optimizer_state(model, optimizer, optim_sd, fsdp)
        return
    shared = load(files[MODEL_FILE]) if MODEL_FILE in files else {}
    if written_by != world_size:  # every rank's shards
        parts = range(written_by)
        load_resharded_model_state(model, [load(files[model_part(k)]) for k in parts], shared, lora)
        load_resharded_optimizer_state(optimizer, [_optim_part(files, k) for k in parts])
    else:  # this rank's own shards only
        load_sharded_model_state(model, load(files[model_part(rank)]), shared, lora)
        load_sharded_optimizer_state(optimizer, _optim_part(files, rank))


def _optim_part(files: dict[str, bytes], rank: int) -> StateDict:
    import io

    import torch

    return torch.load(io.BytesIO(files[optim_part(rank)]), weights_only=True)
