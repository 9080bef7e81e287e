"""Two-process training runs on plain torch.distributed (gloo, CPU) for the sharded-checkpoint tests and benchmark.

``run_world(fn, world, *args)`` starts ``world`` processes, each initializing the process group and calling
``fn(rank, *args)``; what each returns comes back as a list, in rank order.

The ranks are forked from one forkserver per test session that has already imported what a rank imports
(``tests/unit/rank_preload.py``): a spawned rank paid ~5 CPU-s of imports (torch, transformers, peft) before its
first step (67 ranks in one suite run). A forked rank is a fresh process all the same -- nothing has run in the
server but imports -- and gets the caller's environment and working folder as they are now (a forkserver's children
would otherwise inherit the server's, from when it started). A rank of a 4-bit run is spawned: the preloaded libraries
were imported with bitsandbytes hidden, as in any rank of a run without quantization (``forgo_bitsandbytes``).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from ray_jobs.config import Config
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.model.loading import forgo_bitsandbytes

PRELOAD = ["tests.unit.rank_preload"]


def _method(args: tuple) -> str:
    """forkserver (preloaded), unless a run among ``args`` is quantized (see the module's docstring)."""
    quantized = any(isinstance(a, Config) and a.model.quantization != "none" for a in args)
    if quantized:
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts (once a session)
    return "forkserver"


def _as_caller(caller: tuple[dict[str, str], str]) -> None:
    """Take the caller's environment and working folder (a forked rank has the forkserver's)."""
    env, cwd = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args: tuple, out, caller: tuple[dict[str, str], str]) -> None:
    import torch.distributed as dist

    _as_caller(caller)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args: Any) -> list[Any]:
    with mp.Manager() as manager:
        out = manager.dict()
        caller = (dict(os.environ), os.getcwd())
        mp.start_processes(_entry, args=(world, _free_port(), fn, args, out, caller), nprocs=world, join=True,
                           start_method=_method(args))  # fmt: skip
        return [out[r] for r in range(world)]


def _alone(fn, args: tuple, caller: tuple[dict[str, str], str]) -> None:
    _as_caller(caller)
    fn(*args)


def start_alone(fn, *args: Any, env: dict[str, str]) -> Any:
    """``fn(*args)`` in a process of its own (from the preloaded forkserver), the caller's environment plus ``env``;
    started, not joined: the test kills it."""
    proc = mp.get_context(_method(args)).Process(target=_alone, args=(fn, args, ({**os.environ, **env}, os.getcwd())))
    proc.start()
    return proc


def train_alone(cfg: Config, manifest: DatasetManifest, model: str) -> None:
    """A run of one process, no process group (``LocalRuntime``), by the config's engine: resume or start, train."""
    from ray_jobs.train.hf import HfTrainer
    from ray_jobs.train.runtime import LocalRuntime
    from ray_jobs.train.trainer import Trainer

    t = (HfTrainer if cfg.train.engine == "hf" else Trainer)(cfg, manifest, model, LocalRuntime())
    t.resume_or_start()
    t.fit()


def full_weights_hash(trainer) -> str:
    """sha256 of the full weights, the same on every rank (FSDP gathers them; a collective)."""
    from torch.distributed.tensor import DTensor

    state = trainer.model.state_dict()
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}
    full = {k.removeprefix("module."): v for k, v in full.items()}
    return hashlib.sha256(b"".join(full[k].numpy().tobytes() for k in sorted(full))).hexdigest()


def train_rank(rank: int, cfg: Config, manifest: DatasetManifest, model: str, stop_at: int | None) -> dict[str, Any]:
    """One rank of a run: resume or start, train (to ``stop_at``), and say where it resumed and what it read."""
    from ray_jobs.train.hf import HfTrainer
    from ray_jobs.train.runtime import TorchRuntime
    from ray_jobs.train.trainer import Trainer

    forgo_bitsandbytes(cfg.model.quantization)  # a spawned rank, as a Ray Train worker or a torchrun rank does
    t = (HfTrainer if cfg.train.engine == "hf" else Trainer)(cfg, manifest, model, TorchRuntime())
    t.resume_or_start()
    t.fit(stop_at=stop_at)
    return {"step": t.loop.step, "resumed_from": t.resumed_from, "bytes_resumed": t.bytes_resumed,
            "weights": full_weights_hash(t), "stalls_s": t.checkpointer.stalls_s, "eval_loss": t.last_eval}  # fmt: skip


def train_and_export_rank(rank: int, cfg: Config, manifest: DatasetManifest, model: str) -> dict[str, Any]:
    """One rank of a run trained to the end and exported; rank 0 also says where the export went."""
    from ray_jobs.train.runtime import TorchRuntime
    from ray_jobs.train.trainer import Trainer

    forgo_bitsandbytes(cfg.model.quantization)
    t = Trainer(cfg, manifest, model, TorchRuntime())
    t.resume_or_start()
    t.fit()
    weights = full_weights_hash(t)
    return {"weights": weights, "final": t.export_final()}


# -- live recovery without Ray: torchft replicas, each its own world of one, on a lighthouse in this process --------
class LiveRanks:
    """What Ray Train's context gives a live replica: its rank among ``world`` replicas (its own group is alone)."""

    def __init__(self, rank: int, world: int):
        import torch

        self.rank, self.world_size, self._device = rank, world, torch.device("cpu")

    def device(self):
        return self._device


def lighthouse(cfg: Config):
    """A torchft lighthouse with the settings the job gives Ray Train's TorchftConfig (``ray_jobs.job.lighthouse``)."""
    from torchft.coordination import LighthouseServer

    from ray_jobs.job import lighthouse as settings

    return LighthouseServer(bind="[::]:0", **settings(cfg))


HOLD_AT = 20  # the step before which an original replica waits while its ``hold`` file exists


def _gate(hold: str | None, asked: str | None) -> None:
    """Test timing (no number changes): an original replica waits before step ``HOLD_AT`` while the file ``hold``
    exists; a replacement touches ``asked`` as it asks to join. The test lifts the hold once the replacement asked,
    so the survivors cannot finish the run before a slow-starting replacement (a loaded machine) joins it."""
    from torchft import Manager

    from ray_jobs.train.live_trainer import LiveTrainer

    if hold:
        step = LiveTrainer.step

        def held(self):
            deadline = time.monotonic() + 120
            while self.loop.step == HOLD_AT and os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.02)
            return step(self)

        LiveTrainer.step = held
    if asked:
        start_quorum = Manager.start_quorum

        def asks(self, *args, **kwargs):
            Path(asked).touch()
            return start_quorum(self, *args, **kwargs)

        Manager.start_quorum = asks


def _live_entry(rank: int, world: int, address: str, cfg: Config, manifest: DatasetManifest, model: str, out,
                heal_fails: bool = False, gate: tuple[str | None, str | None] = (None, None),
                caller: tuple[dict[str, str], str] | None = None) -> None:  # fmt: skip
    import torch.distributed as dist

    from ray_jobs.train.live_trainer import LiveTrainer

    if caller is not None:
        _as_caller(caller)
    _gate(*gate)
    forgo_bitsandbytes(cfg.model.quantization)

    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      TORCHFT_LIGHTHOUSE=address)  # fmt: skip
    dist.init_process_group("gloo", rank=0, world_size=1)
    if heal_fails:  # the state a peer sends never arrives (as over NCCL between two replicas on one GPU)
        from torchft.checkpointing.pg_transport import PGTransport

        def broken(*args, **kwargs):
            raise ConnectionError("injected: the heal's transfer broke")

        PGTransport.recv_checkpoint = broken
    t = LiveTrainer(cfg, manifest, model, LiveRanks(rank, world), attempt=0, group=1)
    try:  # as ``train_rank`` (no export: a LoRA export merges the adapters into the leader's weights)
        t.resume_or_start()
        t.fit()
        out[rank] = {"step": t.loop.step, "weights": full_weights_hash(t), "resumed_from": t.resumed_from,
                     "heals": t.heals, "leader": t.leader, "eval_loss": t.last_eval}  # fmt: skip
    except Exception as e:
        out[rank] = {"error": f"{type(e).__name__}: {e}"}
        raise
    finally:
        t.close()
        dist.destroy_process_group()


def start_live(rank: int, world: int, address: str, cfg: Config, manifest: DatasetManifest, model: str, out,
               heal_fails: bool = False, gate: tuple[str | None, str | None] = (None, None)):  # fmt: skip
    """Replica ``rank`` of ``world`` as its own process (killed with ``.kill()``, waited with ``.join()``);
    ``heal_fails``: every heal it should receive from a peer breaks in transit; ``gate``: (hold, asked), see
    ``_gate``."""
    ctx = mp.get_context(_method((cfg,)))
    caller = (dict(os.environ), os.getcwd())
    p = ctx.Process(target=_live_entry, daemon=False,
                    args=(rank, world, address, cfg, manifest, model, out, heal_fails, gate, caller))  # fmt: skip
    p.start()
    return p
