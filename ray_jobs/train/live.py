"""Live recovery's parts: this worker as a torchft replica group, and the one-worker view the rest of the loop gets.

With ``fault_tolerance.live_recovery`` Ray Train runs ``TorchftConfig``: every worker is a replica group of one,
whose torch process group is itself alone. What spans workers is torchft's: a lighthouse (an actor on the head)
forms a quorum of the live replicas before each step, the step's gradients are summed over the quorum on a process
group torchft re-forms at every change, and a replica whose step is behind the quorum's heals -- it receives the
whole training state from a live peer over torchft's checkpoint transport (``PGTransport``). Ray Train replaces a
replica group that failed, alone, while the others keep stepping (``_replace_bad_workers``).

Written here by hand, and why: torchft's own ``DistributedDataParallel`` and ``OptimizerWrapper`` average the
gradients over the replicas that happen to take part in a step, so a step trained while one is missing is a smaller
batch than the uninterrupted run's. Here every step trains the micro-batches of all ``N`` replicas -- the survivors
compute a missing replica's share too, *as that replica would have* (its micro-batches, accumulated apart), and the
step's gradient is ``sum over the N shares / N``: at two replicas the same bits whoever computed which share (a sum
of two is order-free, halving is exact), at more the same rows. Only the Manager's quorum, allreduce, commit and
heal are used, each as torchft documents it.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from ray_jobs.checkpoint.checkpointer import Reported
from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat, Heal
from ray_jobs.data.reading import ShardRows
from ray_jobs.train.eval import eval_loss
from ray_jobs.train.runtime import LocalRuntime

log = logging.getLogger("unbroken.train")

# torchft logs every quorum and commit at INFO (~8 lines a step); unbroken logs the changes that matter itself.
QUIET = ("torchft", "torchft.manager", "torchft_quorums", "torchft_commits", "torchft.checkpointing.pg_transport")


def node_ip() -> str:
    """This node's IP as Ray knows it (the machine's own address outside Ray)."""
    import ray

    return ray.util.get_node_ip_address()


def virtual_slots(replicas: int, per: int, shares: list[int]) -> list[list[int]]:
    """Micro-batch indices (into a one-worker :class:`~ray_jobs.data.reading.StepPlan`'s step) of each share this
    worker computes: share ``j`` of ``replicas`` is the ``j``-th run of ``per`` micro-batches, the slots worker
    ``j`` of ``replicas`` runs in an ordinary run (``reading.step_slots``)."""
    return [list(range(j * per, (j + 1) * per)) for j in shares]


def shares_of(participant: int, participants: int, replicas: int) -> list[int]:
    """The shares (of ``replicas``) the ``participant``-th of ``participants`` live replicas computes this step:
    every share exactly once over the quorum, its own first when all are there."""
    return [j for j in range(replicas) if j % participants == participant]


class Solo(LocalRuntime):
    """The one-worker view the loop's unchanged parts run on (resume, checkpoints, eval, export): rank 0 of 1, no
    collectives, nothing reported to Ray Train -- its report is a barrier over every worker, which a replica being
    replaced would hold up (Ray 2.60's torchft example skips it for the same reason). So old checkpoints are
    deleted here instead of by Ray's ``CheckpointConfig``: the newest ``num_to_keep`` sealed ones stay (a folder whose
    write never finished -- a dead job's, at a higher step -- counts for nothing, and is left for a person)."""

    def __init__(self, device, keep: int, checkpoints_dir: str):
        super().__init__(str(device))
        self.keep, self.dir = keep, checkpoints_dir

    def shard_model(self, model):
        raise RuntimeError("live recovery runs DDP only (config validation refuses fsdp)")

    def report(self, metrics: Reported, checkpoint_url: str | None) -> None:
        if checkpoint_url is None:
            return
        from ray_jobs.checkpoint.format import sealed_checkpoints
        from ray_jobs.storage import fs_and_path

        try:
            for url, _ in list(sealed_checkpoints(self.dir, say=False))[self.keep :]:  # newest first
                fs, path = fs_and_path(url)
                fs.rm(path, recursive=True)
        except OSError as e:  # storage away: the old checkpoints go next time, the training goes on
            logging.getLogger("unbroken.live").warning("old checkpoints not removed this time: %s", e)


class StepStuck(RuntimeError):
    """A step this replica could not commit for too long: it leaves (Ray Train replaces it, or the job fails with
    this cause) instead of retrying forever."""


RETRY_FLOOR_S = 1.0  # the unit of Retries' bounds at the least (a heal's tries are not cut short by a quick timeout)


class Retries:
    """How long one step has failed to commit, and when to give up. A replica whose own heal failed gives up after
    ``10 x replica_timeout_s``: it is the one that cannot catch up, and once it leaves the others step without it.
    Any replica gives up after ``60 x replica_timeout_s``: the quorum cannot form at all. (Seen on an H100, two
    replicas sharing the GPU: a heal over NCCL that failed at every quorum held both at one step for minutes.) Never
    under 10 s and 60 s (``RETRY_FLOOR_S``): a heal moves the whole training state, which a loaded host may take
    seconds over, however soon a silent replica is left out."""

    def __init__(self, rank: int, replica_timeout_s: float, clock=time.monotonic):
        self.rank, self.clock, self.since = rank, clock, None
        unit = max(RETRY_FLOOR_S, replica_timeout_s)
        self.behind_s, self.any_s = 10 * unit, 60 * unit

    def failed(self, step: int, cause: BaseException | None, heal_failed: bool) -> None:
        """Record a failed try at ``step``; raise :class:`StepStuck` once this replica has waited long enough."""
        now = self.clock()
        self.since = now if self.since is None else self.since
        waited = now - self.since
        if waited >= (self.behind_s if heal_failed else self.any_s):
            why = f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}" if cause else "no cause given"
            raise StepStuck(
                f"replica {self.rank}: step {step} not committed for {waited:.0f}s"
                f"{' (its heal from a live peer failed)' if heal_failed else ''}; last cause: {why}. "
                "Leaving the quorum so Ray Train replaces this replica"
            )


class Replica:
    """This worker's torchft Manager: the quorum before each step, the sum over it, the commit, the heal."""

    def __init__(self, rank: int, device, timeout_s: float, state_dict, load_state_dict):
        import os

        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
        import torch
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        for name in QUIET:  # their errors too: the loop logs each failed step once, with its cause
            logging.getLogger(name).setLevel(logging.CRITICAL)
        timeout = timedelta(seconds=timeout_s)
        pg = _process_group(device, timeout)
        self.rank, self.heals, self.heal_failed = rank, 0, False
        replica = self

        class Transport(PGTransport):  # torchft logs a heal that failed and carries on: remember it (Retries)
            def recv_checkpoint(self, *args, **kwargs):
                try:
                    return super().recv_checkpoint(*args, **kwargs)
                except Exception:
                    replica.heal_failed = True
                    raise

        self.manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,
            use_async_quorum=False,  # the step's shares depend on who is in it: know the quorum before computing
            init_sync=False,  # every replica starts from the same seed or the same checkpoint
            timeout=timeout,
            quorum_timeout=timeout * 2,
            rank=0,
            world_size=1,
            replica_id=f"unbroken_{rank}",
            checkpoint_transport=Transport(pg, timeout=timeout, device=torch.device(device)),
            hostname=node_ip(),  # what peers dial to heal from it: not a host name they may not resolve
        )

    def quorum(self) -> tuple[int, int]:
        """Join this step's quorum (healing first when behind: the state is loaded before this returns); this
        replica's place in it and its size."""
        self.heal_failed = False
        self.manager.start_quorum()
        return self.manager.participating_rank() or 0, max(1, self.manager.num_participants())

    def set_step(self, step: int, replicas: int) -> None:
        """Where this replica is after a resume from storage (the quorum compares steps: lower ones heal)."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * replicas})

    def sum(self, tensor):
        """``tensor`` summed over the quorum, in place (garbage if the step fails: ``commit`` then says False)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def failure(self) -> BaseException | None:
        """Why this step failed on this replica (the first error reported in it), or None."""
        err = self.manager.errored()
        return getattr(err, "original_exception", err)

    def fail(self, e: Exception) -> None:
        """Fail this step (every replica's commit then says False), unless an error already did: its cause is the
        one the log should name."""
        if self.manager.errored() is None:
            self.manager.report_error(e)

    def commit(self) -> bool:
        """True when every replica of the quorum summed this step's shares: apply it. False: redo it."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _process_group(device, timeout: timedelta):
    """The process group torchft re-forms at every quorum: NCCL on a GPU (run once, two replicas sharing an H100:
    heals failed there), Gloo else."""
    if device.type == "cuda":
        from torchft import ProcessGroupNCCL

        return ProcessGroupNCCL(timeout=timeout)
    from torchft import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timeout)


def timed_heal(replica: Replica, began: float, step: int) -> Heal:
    """What the heartbeat and the log say of a heal this replica just received."""
    replica.heals += 1
    took = time.monotonic() - began
    log.warning("replica %d healed from a live peer at step %d in %.2fs (no storage read)", replica.rank, step, took)
    return Heal(rank=replica.rank, step=step, heal_s=round(took, 3), at=time.time())


def eval_as_replicas(model, rows: ShardRows, replicas: int, device, autocast, micro_batch_size: int, max_batches: int):
    """The loss over ``rows`` as an ordinary run of ``replicas`` workers computes it (each one's slice summed in rank
    order), on this worker alone: every replica knows it, whoever is missing."""
    parts = []
    for r in range(replicas):
        view = _Slice(r, replicas, parts)
        eval_loss(model, rows, view, device, autocast, micro_batch_size, max_batches)
    loss_sum, count = 0.0, 0.0
    for part_loss, part_count in parts:
        loss_sum, count = loss_sum + part_loss, count + part_count
    return loss_sum / max(count, 1.0)


class _Slice:
    """Rank ``rank`` of ``world``'s view for one eval slice: its sums are kept, not reduced (``eval_as_replicas``)."""

    def __init__(self, rank: int, world: int, parts: list):
        self.rank, self.world_size, self.parts = rank, world, parts

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        self.parts.append(tuple(values))
        return list(values)


def attempt_training(cfg: Config, attempt: int) -> bool:
    """This attempt's heartbeat already shows training: this process is a replacement, not the job's start."""
    from ray_jobs.storage import Layout

    try:
        beat = Beat.read(Layout(cfg.storage).heartbeat(cfg.name))
    except Exception:
        return False
    return beat is not None and beat.attempt == attempt and beat.phase != "loading" and beat.replicas is not None
