"""Local mode: a run's training without Ray -- in this process, or multi-process under ``torchrun``.

    unbroken train CONFIG --local [--set k=v ...]                                 # one process
    torchrun --nproc-per-node 2 -m unbroken train CONFIG [--set ...]              # DDP/FSDP, gloo or NCCL
    python -m ray_jobs.local --spec <url of a job spec>                           # a spec the flow wrote
    torchrun --nproc-per-node 2 -m ray_jobs.local --spec <url of a job spec>

The loop is the one Ray Train runs (``train.worker.run_worker``), with the same job spec, storage layout,
checkpoints, exact resume and final folder: a run stopped under one resumes under the other, bit-identical at the same
world size. ``unbroken train`` prepares what the flow would (the base model, the staged dataset: cache hits when
there already) without Prefect, on rank 0 while the other ranks wait, then every rank trains. Under torchrun the
process group is set up here (NCCL when ``cluster.use_gpu``, else gloo) and each rank writes its own part of every
checkpoint, as Ray Train's workers do.

What needs Ray is refused before anything is prepared (:func:`local_problems`): elastic world sizes, several
machines, live recovery, a warm start from a series (the registry's). Not here either: the run registry, the watchdog, Ray Train's
restarts of a failed worker group, preemption notices -- a local run that dies is resumed by running it again.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from ray_jobs.config import Config, ConfigError, job_spec
from ray_jobs.config.engine import refusal
from ray_jobs.config.engines import engine_of
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.contracts.job_spec import AttemptInputs, JobSpec, WorkerSpec
from ray_jobs.secrets import mask_output
from ray_jobs.storage import Layout

if TYPE_CHECKING:
    from ray_jobs.train.runtime import Runtime

log = logging.getLogger("unbroken.local")


def world() -> tuple[int, int, int]:
    """(rank, world size, processes on this machine) as torchrun sets them; (0, 1, 1) in a plain process."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    return int(env.get("RANK", "0")), size, int(env.get("LOCAL_WORLD_SIZE", str(size)))


def local_problems(cfg: Config, world_size: int, local_world_size: int, cuda_devices: int) -> list[str]:
    """Why ``cfg`` cannot train in local mode with this many processes (each naming the field), or []."""
    c, out = cfg.cluster, []
    if c.elastic:
        out.append(
            f"cluster.num_workers: elastic ({{min: {c.min_workers}, max: {c.max_workers}}}) needs Ray Train, "
            "which restarts the group at another size; local mode runs a fixed number of processes "
            "(set a number, or use `unbroken run`)"
        )
    if local_world_size != world_size:
        out.append(
            f"local mode trains on one machine ({world_size} processes, {local_world_size} here): several "
            "machines are Ray's job (`unbroken run` with cluster.backend), or torchrun --nnodes 1"
        )
    if not c.elastic and (world_size > c.max_workers or c.max_workers % world_size):
        out.append(
            f"cluster.num_workers: the data is laid out for {c.max_workers} workers; {world_size} processes "
            f"cannot split it (use {c.max_workers} or a divisor of it)"
        )
    if c.use_gpu and cuda_devices < local_world_size:
        out.append(
            f"cluster.use_gpu: {local_world_size} process(es) need as many CUDA devices; this machine has "
            f"{cuda_devices}"
        )
    if not (engine := engine_of(cfg)).local_mode:
        out.append(refusal(engine, "local_mode"))
    if cfg.model.init_from != "base":
        out.append(
            f"model.init_from: {cfg.model.init_from} starts from the series' registry, which local mode does "
            "not read; use `unbroken run`, or name the model folder in model.name_or_path"
        )
    return out


def check_local(cfg: Config) -> None:
    """Raise a ConfigError listing every reason ``cfg`` cannot train here, before anything is prepared."""
    import torch

    _, size, local = world()
    problems = local_problems(cfg, size, local, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if problems:
        raise ConfigError(problems)


def prepare(cfg: Config) -> WorkerSpec:
    """What ``run_worker`` is given, made here without Prefect: the base model (built when it is the built-in one
    and missing) and the staged dataset (a content-addressed cache hit when staged already)."""
    from ray_jobs.data.staging import stage
    from ray_jobs.job import worker_config
    from ray_jobs.model.builtin import ensure_base_model
    from ray_jobs.model.loading import load_tokenizer

    model_path, _ = ensure_base_model(cfg)
    staged = stage(cfg.data, load_tokenizer(model_path, cfg.data.cache_dir), model_path, cfg.storage)
    log.info("dataset %s (%s)", staged.dataset_id, "cache hit" if staged.cache_hit else "staged")
    return worker_config(cfg, staged.manifest, inputs_of(cfg, staged.manifest, model_path))


def inputs_of(cfg: Config, manifest: DatasetManifest, model_path: str) -> AttemptInputs:
    """What a run trained here is given: the dataset staged under ``cfg.storage`` and the weights at
    ``model_path`` (no series, no samples: local mode and the benchmarks)."""
    return AttemptInputs(manifest_url=Layout(cfg.storage).dataset_manifest(manifest.dataset_id), model_path=model_path)


def runtime(cfg: Config) -> Runtime:
    """The Runtime this process trains through: torch.distributed under torchrun (WORLD_SIZE > 1; NCCL when
    ``cluster.use_gpu``), else in-process on the GPU (``use_gpu``) or the CPU."""
    _, size, _ = world()
    if size > 1:
        import torch.distributed as dist

        from ray_jobs.train.runtime import TorchRuntime

        if not dist.is_initialized():
            dist.init_process_group("nccl" if cfg.cluster.use_gpu else "gloo")
        return TorchRuntime()
    from ray_jobs.train.runtime import LocalRuntime

    return LocalRuntime("cuda" if cfg.cluster.use_gpu else "cpu")


def train(cfg: Config) -> str | None:
    """``unbroken train``: check, prepare (rank 0), train every rank; the final folder's URL on rank 0."""
    check_local(cfg)
    rank, size, _ = world()
    loop, failed = None, ""
    if size > 1:
        rt = runtime(cfg)  # the process group first: the other ranks wait in it while rank 0 prepares
        if rank == 0:
            try:
                loop = prepare(cfg)
            except Exception as e:  # every rank must hear of it, or the others wait in the broadcast for ever
                failed = f"{type(e).__name__}: {e}"
        loop, failed = rt.broadcast_object((loop, failed))
        if failed:
            raise RuntimeError(f"rank 0 could not prepare the run: {failed}")
    else:
        loop = prepare(cfg)
        rt = runtime(cfg)
    return _run(loop, rt)


def _run(loop: WorkerSpec, rt: Runtime) -> str | None:
    import torch.distributed as dist

    from ray_jobs.storage import Layout
    from ray_jobs.train.worker import run_worker

    try:
        trainer = run_worker(loop, rt)
        if rt.world_size > 1:  # every rank leaves the group together, once rank 0's export is done
            dist.barrier()
    finally:
        if rt.world_size > 1:
            dist.destroy_process_group()
    return Layout(trainer.cfg.storage).final_model(trainer.cfg.name) if rt.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    mask_output()  # what it prints never shows a credential (ray_jobs/secrets.py)
    spec, cfg = job_spec("ray_jobs.local", JobSpec, argv)
    from ray_jobs.job import loop_config

    check_local(cfg)
    _run(loop_config(spec, cfg), runtime(cfg))
    return 0


def leave(code: int) -> NoReturn:
    """Exit a torchrun rank whose work is done -- its trackers closed, its files on storage, its process group
    destroyed -- without the interpreter's teardown. There, C++ threads of what a rank loaded (gloo's, a trainer's)
    can abort the process: a DPO rank that had finished every step died so, SIGABRT ("terminate called without an
    active exception"; pytorch/pytorch#190489 is the same crash), and torchrun reported the whole run failed. What
    Python would still have done that matters here -- flushing the logs and the output -- is done first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())  # an error still raises out of main(): its traceback and exit status are Python's own
