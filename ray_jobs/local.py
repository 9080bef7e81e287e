"""Training without Ray: a job spec's training in this process, or multi-process under ``torchrun``.

    python -m ray_jobs.local --spec <url of a job spec>                               # one process
    torchrun --nproc-per-node 2 -m ray_jobs.local --spec <url of a job spec>          # DDP/FSDP, gloo or NCCL

The same loop as on Ray (``train.trainer.run_worker``) with the same job spec, checkpoints, resume and final folder:
a run stopped under one resumes under the other. Under torchrun the process group is set up here (NCCL when a GPU
is visible to every rank, else gloo) and each rank writes its own part of every checkpoint, as Ray Train's workers do.
What needs Ray is not here: Ray Train's restarts of a failed worker group, elastic world sizes, preemption notices.
"""

from __future__ import annotations

import os
import sys

from ray_jobs.config import job_spec


def runtime():
    """The Runtime this process trains through: torch.distributed under torchrun (WORLD_SIZE set), else in-process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        import torch.distributed as dist

        from ray_jobs.train.runtime import TorchRuntime

        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        dist.init_process_group("nccl" if cuda else "gloo")
        return TorchRuntime()
    from ray_jobs.train.runtime import LocalRuntime

    return LocalRuntime()


def main(argv: list[str] | None = None) -> int:
    from ray_jobs.job import loop_config
    from ray_jobs.train.trainer import run_worker

    spec, cfg = job_spec("ray_jobs.local", argv)
    rt = runtime()
    try:
        run_worker(loop_config(spec, cfg), rt)
    finally:
        if rt.world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
