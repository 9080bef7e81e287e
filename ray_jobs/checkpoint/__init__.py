"""What a checkpoint holds, how it is written (each rank its own part, in the background, manifest last) and how
it is trusted.

One checkpoint is one folder ``<storage>/ray/<run>/checkpoint-step-<step>/``:

    state.json                      rank 0: loop state, LR scheduler, last eval, the config used, the data cursor
    rank-<r>.json                   every rank: its RNG streams (and its data rank's cursor)
    model.safetensors, optim.pt     DDP / one process: the replicated weights and optimizer state, once (rank 0)
    model-rank-<r>.safetensors,     FSDP: each rank's own shards of weights and optimizer state, never gathered
    optim-rank-<r>.pt
    manifest.json                   rank 0, last, once every rank's write finished: size + sha256 of every file

Each rank serializes and writes its own files on a background thread and reports their size and sha256 (computed
as written, never by reading back). A folder without a readable manifest, or whose files don't match it, is never
loaded. Choosing a checkpoint reads only manifests and one listing (no tensor bytes); a rank then reads and
verifies just the shared files and its own, and if any rank finds a file bad, all fall back to the previous one
together. Nothing is unpickled beyond ``weights_only`` tensors. Format-1 checkpoints (one full copy written by
rank 0) still load.

``state.json`` also holds the run's global data cursor (where every data rank is, ``reading.StepPlan``), so a
checkpoint resumes at another world size (an elastic run) on exactly the rows it would have trained next; an FSDP one
is then resharded: each rank reads every rank's shards and cuts its own (``load_resharded_*``).

When a checkpoint is taken, and how a write is committed (parts, then the manifest, then Ray's report), deferred
while the previous one is in flight, or abandoned when a store refused it, is the :class:`Checkpointer`'s; the
trainer calls it at every step boundary.

Why not torch.distributed.checkpoint: its writers report no checksums, so the manifest would need a second read of
every byte; this layout is DCP's idea (each rank writes its part, a metadata file last) with the sha256 our manifest
needs, and resharding FSDP2's dim-0 shards is a concatenation and a cut.
"""

from ray_jobs.checkpoint.checkpointer import Checkpointer
from ray_jobs.checkpoint.format import (
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILE,
    CheckpointInvalid,
    Part,
    StorageUnreachable,
    check,
    checkpoint_name,
    checkpoint_step,
    decode,
    encode_file,
    find_latest_valid,
    list_checkpoints,
    model_part,
    optim_part,
    owner,
    rank_file,
    rank_files,
    read_files,
    read_manifest,
    read_verified,
    refuse,
    write_manifest,
    write_part,
)
from ray_jobs.checkpoint.rng import rng_state, set_rng_state
from ray_jobs.checkpoint.state import (
    HostStaging,
    LoopState,
    load_model_state,
    load_optimizer_state,
    load_resharded_model_state,
    load_resharded_optimizer_state,
    load_sharded_model_state,
    load_sharded_optimizer_state,
    load_tensor_files,
    loop_state_file,
    model_state,
    optimizer_state,
    rank_state,
    sharded_model_state,
    sharded_optimizer_state,
    tensor_files,
    tied_aliases,
    trainable_names,
    unwrap,
)
from ray_jobs.checkpoint.writer import AsyncWriter

__all__ = [
    "FORMAT", "MANIFEST_FILE", "MODEL_FILE", "OPTIM_FILE", "STATE_FILE", "AsyncWriter", "CheckpointInvalid", "StorageUnreachable",
    "Checkpointer", "HostStaging", "LoopState", "Part", "check", "checkpoint_name", "checkpoint_step",
    "decode", "encode_file", "find_latest_valid", "list_checkpoints", "load_model_state", "load_optimizer_state",
    "load_resharded_model_state", "load_resharded_optimizer_state", "load_sharded_model_state",
    "load_sharded_optimizer_state", "load_tensor_files", "loop_state_file", "model_part", "model_state", "optim_part",
    "optimizer_state", "owner", "rank_file", "rank_files", "rank_state", "read_files", "read_manifest",
    "read_verified", "refuse", "rng_state", "set_rng_state", "sharded_model_state", "sharded_optimizer_state",
    "tensor_files", "tied_aliases", "trainable_names", "unwrap", "write_manifest", "write_part",
]  # fmt: skip
