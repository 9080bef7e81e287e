"""What a checkpoint holds, and writing/reading it. All resumable state goes through here.

Layout of one checkpoint folder (Ray Train merges every rank's files into one folder):
    model.safetensors   weights of the unwrapped model (rank 0; identical on every DDP rank)
    optim.pt            optimizer + LR scheduler state (rank 0; identical on every DDP rank)
    state.json          loop state: step, tokens seen, elapsed time, world size, dataset id (rank 0)
    rank-00000.pt ...   per rank: data cursor and RNG states
Tensors are loaded without arbitrary unpickling (safetensors, ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ray_jobs.data import Cursor

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.pt"
STATE_FILE = "state.json"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


@dataclass
class LoopState:
    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    world_size: int = 1
    dataset_id: str = ""


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def save(ckpt_dir: Path, rank: int, model, optimizer, scheduler, loop: LoopState, cursor: Cursor) -> Path:
    """Write this rank's part of a checkpoint into ``ckpt_dir``."""
    import torch
    from safetensors.torch import save_file

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        state = {k: v.detach().contiguous().cpu() for k, v in unwrap(model).state_dict().items()}
        save_file(state, str(ckpt_dir / MODEL_FILE))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, ckpt_dir / OPTIM_FILE)
        (ckpt_dir / STATE_FILE).write_text(json.dumps(asdict(loop), indent=2))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"cursor": asdict(cursor), "rng": rng}, ckpt_dir / rank_file(rank))
    return ckpt_dir


def load(ckpt_dir: Path, rank: int, world_size: int, model, optimizer, scheduler) -> tuple[LoopState, Cursor]:
    """Restore model, optimizer, scheduler and this rank's cursor and RNG from ``ckpt_dir``."""
    import torch
    from safetensors.torch import load_file

    loop = LoopState(**json.loads((ckpt_dir / STATE_FILE).read_text()))
    if loop.world_size != world_size:
        raise RuntimeError(
            f"checkpoint {ckpt_dir} was written by {loop.world_size} workers but this run has {world_size}; "
            "exact resume needs the same cluster.num_workers"
        )
    unwrap(model).load_state_dict(load_file(str(ckpt_dir / MODEL_FILE)))
    opt = torch.load(ckpt_dir / OPTIM_FILE, weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    mine = torch.load(ckpt_dir / rank_file(rank), weights_only=True)
    torch.set_rng_state(mine["rng"]["torch"])
    if "cuda" in mine["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["rng"]["cuda"])
    return loop, Cursor(**mine["cursor"])
