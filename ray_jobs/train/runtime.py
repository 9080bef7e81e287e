"""Where the training loop runs: Ray Train in production, plain torch.distributed (torchrun) or a plain process in
tests and benchmarks.

The loop only talks to a :class:`Runtime`, so the same code trains in-process in a test and on a Ray cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ray_jobs.checkpoint.checkpointer import Reported


@dataclass(frozen=True)
class DrainNotice:
    """Ray Train's notice that a node of this group is being drained (``ray.train.get_preemption_info``): when it
    goes (epoch ms; None: Ray gave no deadline) and the group's ranks on each drained node."""

    deadline_ms: float | None = None
    nodes: dict[str, list[int]] = field(default_factory=dict)


class Runtime(Protocol):
    rank: int
    world_size: int

    def prepare_model(self, model): ...

    def shard_model(self, model): ...

    def device(self): ...

    def report(self, metrics: Reported, checkpoint_url: str | None) -> None:
        """Tell the platform about progress, and about a checkpoint already written to storage."""

    def all_reduce_sum(self, values: list[float]) -> list[float]: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def preemption_notice(self) -> DrainNotice | None:
        """A drain notice for a node of this group (every rank calls it together; all get the same answer)."""


def shard_with_fsdp(model) -> Any:
    """FSDP2: shard every decoder block (HF ``_no_split_modules``), then the root."""
    from torch.distributed.fsdp import fully_shard

    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ValueError(f"train.parallelism=fsdp: no decoder blocks ({block_types}) found in {type(model).__name__}")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def bind_device(device):
    """Make ``device`` this process's current CUDA device (a no-op on CPU): NCCL's object collectives
    (``all_gather_object``) stage their bytes on ``torch.cuda.current_device()``, which would be GPU 0 on every
    rank otherwise."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class RayRuntime:
    """Ray Train V2: ranks from the train context, DDP/FSDP on its process group, reports to its controller."""

    def __init__(self):
        import ray.train
        from ray.train.torch import get_device

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self._device = bind_device(get_device())

    def prepare_model(self, model):
        from ray.train.torch import prepare_model

        return prepare_model(model)

    def shard_model(self, model):
        return shard_with_fsdp(model.to(self.device()))

    def device(self):
        return self._device

    def report(self, metrics: Reported, checkpoint_url: str | None) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        ckpt = None
        if checkpoint_url is not None:
            # Already written under the run's storage by unbroken's writer: register it where it is.
            storage = ray.train.get_context().get_storage()
            name = checkpoint_url.rstrip("/").rsplit("/", 1)[-1]
            path = f"{storage.experiment_fs_path.rstrip('/')}/{name}"
            ckpt = Checkpoint(path=path, filesystem=storage.storage_filesystem)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return list(values)
        # On the backend's device: NCCL reduces only CUDA tensors, gloo CPU ones (the device follows use_gpu).
        t = torch.tensor(values, dtype=torch.float64, device=self.device())
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (what a decision made once looks like everywhere)."""
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)  # NCCL: on the current device (set in bind_device)
        return box[0]

    def preemption_notice(self) -> DrainNotice | None:
        """Ray Train's own preemption signal (its watcher polls the GCS for draining nodes of this group and marks
        every worker), or None. A barrier across ranks."""
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        return DrainNotice(info.deadline_ms, {n: list(r) for n, r in info.preempted_node_to_ranks.items()})


class TorchRuntime(RayRuntime):
    """Plain ``torch.distributed`` (torchrun, tests, benchmarks): the process group is already initialized; DDP/FSDP
    and collectives as under Ray; ``reports`` records what the loop reported instead of telling a controller."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
        self._device = bind_device(torch.device(f"cuda:{local}") if cuda else torch.device("cpu"))
        self.reports: list[tuple[Reported, str | None]] = []

    def prepare_model(self, model):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self._device)
        return DistributedDataParallel(model) if self.world_size > 1 else model

    def report(self, metrics: Reported, checkpoint_url: str | None) -> None:
        self.reports.append((dict(metrics), checkpoint_url))

    def preemption_notice(self) -> DrainNotice | None:
        return self.notice  # no controller: a test sets it

    notice: DrainNotice | None = None


class LocalRuntime:
    """One process, rank 0 of 1, on ``device`` (``cpu``, ``cuda``, ``cuda:1``; default cpu). ``reports`` records what
    the loop reported (metrics, checkpoint url)."""

    def __init__(self, device: str = "cpu"):
        import torch

        self.rank = 0
        self.world_size = 1
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # set_device needs an index: this process's current GPU
            dev = torch.device("cuda", torch.cuda.current_device())
        self._device = bind_device(dev)
        self.reports: list[tuple[Reported, str | None]] = []

    def prepare_model(self, model):
        return model.to(self._device)

    def shard_model(self, model):
        return model.to(self._device)

    def device(self):
        return self._device

    def report(self, metrics: Reported, checkpoint_url: str | None) -> None:
        self.reports.append((dict(metrics), checkpoint_url))

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def preemption_notice(self) -> DrainNotice | None:
        return self.notice  # no controller: a test sets it

    notice: DrainNotice | None = None
