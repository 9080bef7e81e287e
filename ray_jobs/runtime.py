"""Where the training loop runs: Ray Train in production, a plain process in unit tests.

The loop only talks to a :class:`Runtime`, so the same code trains in-process in a test and on a Ray cluster.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol


class Runtime(Protocol):
    rank: int
    world_size: int

    def prepare_model(self, model): ...

    def device(self): ...

    def latest_checkpoint_dir(self) -> tuple[Any, Path] | None:
        """(context manager owner, local dir) of the checkpoint Ray restored, or None when starting fresh."""

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None: ...

    def all_reduce_sum(self, values: list[float]) -> list[float]: ...


class RayRuntime:
    """Ray Train V2: ranks from the train context, DDP via ``prepare_model``, checkpoints via ``ray.train.report``."""

    def __init__(self):
        import ray.train

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()

    def prepare_model(self, model):
        from ray.train.torch import prepare_model

        return prepare_model(model)

    def device(self):
        from ray.train.torch import get_device

        return get_device()

    def latest_checkpoint_dir(self):
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return None
        cm = ckpt.as_directory()
        return cm, Path(cm.__enter__())

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        import ray.train
        from ray.train import Checkpoint

        ckpt = Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()


class LocalRuntime:
    """One process, rank 0 of 1; checkpoints are kept as numbered folders under ``root``."""

    def __init__(self, root: str | Path):
        self.rank = 0
        self.world_size = 1
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.reports: list[dict[str, Any]] = []

    def prepare_model(self, model):
        return model

    def device(self):
        import torch

        return torch.device("cpu")

    def checkpoints(self) -> list[Path]:
        return sorted(self.root.glob("checkpoint_*"))

    def latest_checkpoint_dir(self):
        found = self.checkpoints()
        return (None, found[-1]) if found else None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir:
            dest = self.root / f"checkpoint_{len(self.checkpoints()):06d}"
            tmp = Path(tempfile.mkdtemp(dir=self.root))
            shutil.copytree(checkpoint_dir, tmp, dirs_exist_ok=True)
            tmp.rename(dest)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)
