"""What a checkpoint holds, how it is written (in the background, manifest last) and how it is trusted.

One checkpoint is one folder ``<storage>/ray/<run>/checkpoint-step-<step>/`` written by rank 0 alone:

    model.safetensors   model weights (full, a tied tensor once; only the trainable weights for LoRA runs)
    optim.pt            optimizer state (full, also under FSDP), loaded with ``torch.load(weights_only=True)``
    state.json          loop state, LR scheduler, every rank's data cursor and RNG states, the config used
    manifest.json       written last: format, step, sha256 + size of every file above

A folder without a readable manifest, or whose files don't match it, is never loaded: the loader says why and
falls back to the previous valid checkpoint. Nothing is unpickled beyond ``weights_only`` tensors.

The training thread only copies state into host memory (:func:`take_snapshot`); serializing and writing happen
in :class:`AsyncWriter`'s thread, at most one write in flight.
"""

from ray_jobs.checkpoint.format import (
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILE,
    CheckpointInvalid,
    Snapshot,
    checkpoint_name,
    checkpoint_step,
    decode,
    encode,
    find_latest_valid,
    list_checkpoints,
    read_verified,
    write,
)  # fmt: skip
from ray_jobs.checkpoint.state import (
    LoopState,
    RankState,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
    rank_state,
    rng_state,
    set_rng_state,
    tied_aliases,
    trainable_names,
    unwrap,
)  # fmt: skip
from ray_jobs.checkpoint.writer import AsyncWriter

__all__ = [
    "FORMAT", "MANIFEST_FILE", "MODEL_FILE", "OPTIM_FILE", "STATE_FILE", "AsyncWriter", "CheckpointInvalid",
    "LoopState", "RankState", "Snapshot", "checkpoint_name", "checkpoint_step", "decode", "encode",
    "find_latest_valid", "list_checkpoints", "load_model_state", "load_optimizer_state", "model_state",
    "optimizer_state", "rank_state", "read_verified", "rng_state", "set_rng_state", "tied_aliases", "trainable_names", "unwrap",
    "write",
]  # fmt: skip
