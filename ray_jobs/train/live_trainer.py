"""The training loop under live recovery (``fault_tolerance.live_recovery``; the parts and the why: :mod:`.live`).

Every worker runs this loop on a one-worker view of the run (:class:`~.live.Solo`): it reads every data rank's rows
and computes, each step, the shares of the replicas it stands for -- its own when all are there, a lost one's too
while Ray Train replaces it. A standby (``fault_tolerance.standby_replicas``: workers beyond the data ranks) takes
part in every step and computes no share until a worker is lost; then it computes that worker's. A step is applied
only when torchft commits it (every replica of the quorum summed the same step); one a failure interrupted is
computed again, from the same cursor, never half-applied.

One replica *leads*: it writes the heartbeat, the metrics log, the trackers' rows and the storage checkpoints, and
exports at the end. The leader stays while it takes part; when it is lost the lowest live replica takes over (or
the leader's replacement, when it rejoined before a step went without it) and writes again the rows of this attempt
every replica keeps (``history``), so the log and the trackers hold each step once. Who took part in each step, and
who healed in how long, is in the step's sum: every replica knows it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import Any, Self

from ray_jobs import faults
from ray_jobs.checkpoint import LoopState, rng_state, set_rng_state, trainable_names
from ray_jobs.contracts.checkpoint import StateDict
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.contracts.heartbeat import Heal, LiveFields
from ray_jobs.contracts.job_spec import WorkerSpec
from ray_jobs.contracts.metrics import MetricsRow
from ray_jobs.data.reading import Cursor, StepPlan
from ray_jobs.train import preemption, rowtrace
from ray_jobs.train.agreement import Agreed
from ray_jobs.train.heartbeat import start_heartbeat
from ray_jobs.train.live import (
    Replica,
    Retries,
    Solo,
    attempt_training,
    eval_as_replicas,
    shares_of,
    timed_heal,
    virtual_slots,
)
from ray_jobs.train.model import clip_grads, micro_loss, to_device
from ray_jobs.train.trainer import Trainer

log = logging.getLogger("unbroken.train")
HEAD = 4  # the step's sum: loss, tokens, the step each replica is at, how many were SIGTERMed; then per replica


class LiveTrainer(Trainer):
    def __init__(self, cfg, manifest: DatasetManifest, model_path: str, rt, attempt: int, group: int = 0):
        # replicas: the data ranks, whose shares make every step; workers: the processes (standbys included)
        self.ray_rank, self.replicas, self.workers = rt.rank, cfg.cluster.max_workers, rt.world_size
        self.leader: int | None = None  # the Ray rank of the replica that writes (module docstring)
        self.participants: list[int] = []
        self.history: list[MetricsRow] = []  # this attempt's logged rows, kept by every replica
        self.history_base: int | None = None  # the step the log keeps rows up to (None: a fresh run)
        self.heals: list[Heal] = []  # every heal of this attempt (every replica learns of each)
        self.healed: Heal | None = None  # the heal this replica received, until the step's sum carries it
        self.state_received = False  # a live peer's state was loaded into this replica, its heal not yet timed
        self.replica: Replica | None = None
        self._quorum: tuple[int, int] | None = None  # the joining quorum: the first step's
        self.replacement = attempt_training(cfg, attempt)  # Ray Train replaced a lost replica with this process
        self.fresh = rt.rank == 0 and not self.replacement  # shows `loading` until a leader is known
        beat = start_heartbeat(cfg, attempt, writes=self._writes_heartbeat)
        solo = Solo(rt.device(), cfg.checkpoint.num_to_keep, "")
        super().__init__(cfg, manifest, model_path, solo, beat)
        solo.dir = self.layout.checkpoints_dir(cfg.name)
        self.attempt, self.per = attempt, self.plan.micro_batches // self.replicas
        if self.trace is not None:  # one group per job (its replicas train each step together), ranks as Ray's
            self.trace = rowtrace.RowTrace(os.environ[rowtrace.ENV], group, self.ray_rank, self.workers)

    @classmethod
    def for_worker(cls, cfg, spec: WorkerSpec, rt, heartbeat=None) -> Self:
        return cls(cfg, spec.manifest, spec.inputs.model_path, rt, spec.attempt, spec.group)  # its heartbeat: its own

    def load_data(self) -> None:
        super().load_data()  # as one worker: every data rank's rows (this replica may compute anyone's share)
        assert isinstance(self.plan, StepPlan) and self.plan.micro_batches % self.replicas == 0

    def _writes_heartbeat(self) -> bool:
        return self.leader == self.ray_rank if self.leader is not None else self.fresh

    def live_state(self) -> LiveFields:
        """The heartbeat's live-recovery fields: who took part in the last step, who healed."""
        missing = self.workers - len(self.participants) if self.participants else 0
        last = self.heals[-1] if self.heals else None
        return {
            "replicas": self.workers,
            "participants": len(self.participants) or self.workers,
            "standby": self.workers - self.replicas,
            "healing": missing > 0,
            "heals": len(self.heals),
            "last_heal": last,
        }

    # -- joining: heal from a live peer, or resume from storage like any run ---------------------------------------
    def resume_or_start(self, explicit_checkpoint: str | None = None) -> None:
        self.enter_phase("loading")
        timeout_s = max(10.0, 10 * self.cfg.fault_tolerance.replica_timeout_s)
        self.replica = Replica(self.ray_rank, self.device, timeout_s, self._heal_state, self._load_heal_state)
        self._quorum = self._join()
        if self.healed is not None:
            self.resumed_from = "a live peer"
            return
        super().resume_or_start(explicit_checkpoint)  # nobody ahead: a job (re)start
        self.replica.set_step(self.loop.step, self.replicas)

    def open_log(self, resumed: int | None) -> None:
        self.history_base = resumed  # opened when this replica leads (_lead)

    def _heal_state(self) -> StateDict:
        """Everything a replica that joins behind needs, sent by torchft from this live one."""
        names = trainable_names(self.model) if self.lora else None
        model = {k: v for k, v in self.model.state_dict().items() if names is None or k in names}
        return {
            "model": model,
            "optim": self.optimizer.state_dict(),
            "sched": self.scheduler.state_dict(),
            "loop": asdict(self.loop),
            "cursors": [asdict(c) for c in self.cursors],
            "last_eval": self.last_eval,
            "leader": self.leader,
            "history": self.history,
            "history_base": self.history_base,
            "heals": [h.dump() for h in self.heals],
            "rng": rng_state(),
        }

    def _load_heal_state(self, sd: StateDict) -> None:
        self.model.load_state_dict(sd["model"], strict=not self.lora)
        self.optimizer.load_state_dict(sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.loop, self.cursors = LoopState(**sd["loop"]), [Cursor(**c) for c in sd["cursors"]]
        self.last_eval, self.leader = sd["last_eval"], sd["leader"]
        self.history, self.history_base, self.heals = (
            list(sd["history"]),
            sd["history_base"],
            [Heal.model_validate(h) for h in sd["heals"]],
        )
        set_rng_state(sd["rng"])
        self.checkpointer.last_step = self.loop.step
        self.state_received = True  # the heal is timed by _join

    @property
    def joined(self) -> Replica:
        """This worker's replica, which ``resume_or_start`` makes before any step (``close`` allows for none)."""
        assert self.replica is not None, "resume_or_start makes the replica before it joins or steps"
        return self.replica

    def _join(self) -> tuple[int, int]:
        """This step's quorum; a replica behind it (a newcomer, or one that missed a commit) receives the whole
        state from a live peer first (``_load_heal_state``)."""
        began = time.monotonic()
        quorum = self.joined.quorum()
        if self.state_received:
            self.healed, self.state_received = timed_heal(self.joined, began, self.loop.step), False
        return quorum

    # -- a step ---------------------------------------------------------------------------------------------------
    def step(self) -> Agreed:
        faults.on_step()
        started = time.monotonic()
        retries = Retries(self.ray_rank, self.cfg.fault_tolerance.replica_timeout_s)
        while True:
            place, size = self._quorum or self._join()
            self._quorum = None
            grads, local = self._compute(place, size)
            v = self.joined.sum(self._vector(local))
            consistent = self._consistent(v, size)
            if self.joined.commit() and consistent:
                break
            cause = self.joined.failure()
            log.warning(
                "replica %d: step %d not committed (%s: %s); computing it again",
                self.ray_rank,
                self.loop.step + 1,
                type(cause).__name__,
                str(cause).splitlines()[0][:200] if cause else "",
            )
            retries.failed(self.loop.step + 1, cause, self.joined.heal_failed)  # raises StepStuck when stuck
            self._discard()
        return self._apply(grads, v, started)

    def _compute(self, place: int, size: int):
        """This replica's shares of the step: their gradients summed (one flat tensor), then summed over the
        quorum; and this replica's (loss, tokens), which ``_step`` sums over the quorum with the step's flags."""
        import torch

        self.model.train()
        shares = shares_of(place, size, self.replicas)
        flat, loss, tokens = None, 0.0, 0
        for slots in virtual_slots(self.replicas, self.per, shares):
            self.optimizer.zero_grad(set_to_none=True)
            share_loss, share_tokens = self._share(slots)
            g = torch.cat([p.grad.reshape(-1) for p in self._params()])
            flat = g if flat is None else flat.add_(g)  # two shares: g0 + g1, what the quorum's sum gives
            loss, tokens = loss + share_loss, tokens + share_tokens
        if flat is None:  # a standby while every data rank has its worker: zeros to the sum (x + 0 is exact)
            params = self._params()
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device)
        if self.trace is not None:  # (before the sum: a replica killed once its share counted has left its rows)
            self.trace.computed(self.loop.step + 1)
        return self.joined.sum(flat), (loss, tokens)

    def _share(self, slots: list[int]) -> tuple[float, int]:
        """One replica's micro-batches, accumulated as that replica accumulates them in an ordinary run."""
        import torch

        loss_sum, tokens, n = torch.zeros((), dtype=torch.float64), 0, len(slots)
        for k in slots:
            mb = self.plan.micro_batch(self.cursors, k, self.trace)
            self.rows_materialized += len(mb.idx)
            tokens += mb.tokens
            ids, labels, pos = (to_device(x, self.device) for x in mb.arrays)
            with self.autocast():
                loss = micro_loss(self.model, ids, labels, pos, mb.learned)
            (loss / n).backward()
            loss_sum += loss.detach().to(torch.float64).cpu() / n
        return float(loss_sum), tokens

    def _params(self) -> list[Any]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _vector(self, local: tuple[float, int]):
        import torch

        v = torch.zeros(HEAD + 2 * self.workers, dtype=torch.float64, device=self.device)
        v[0], v[1], v[2], v[3] = local[0], local[1], self.loop.step, float(preemption.requested())
        v[HEAD + self.ray_rank] = 1.0
        if self.healed and self.replacement:  # (a replica that only joined late, or missed a commit, heals too)
            v[HEAD + self.workers + self.ray_rank] = max(self.healed.heal_s, 1e-6)
        return v

    def _consistent(self, v, size: int) -> bool:
        """Every replica of the quorum stands at this step (else the lower one heals at the next quorum)."""
        ok = int(v[2]) == self.loop.step * size and int(v[HEAD : HEAD + self.workers].sum()) == size
        if not ok:
            self.joined.fail(RuntimeError("the quorum's replicas are at different steps"))
        return ok

    def _discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.trace is not None:
            self.trace.rows = []

    def _apply(self, grads, v, started: float) -> Agreed:
        """The committed step: the mean of the replicas' shares into the gradients, then the optimizer."""
        offset = 0
        grads.div_(self.replicas)
        for p in self._params():
            g = grads[offset : offset + p.numel()].view_as(p)
            if p.grad is None:  # a standby computed no share: its gradients are the quorum's sum alone
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += p.numel()
        self.cursors = self.plan.after(self.cursors)
        grad_norm = clip_grads(self.model, self.cfg.train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loop.step += 1
        participants = [r for r in range(self.workers) if v[HEAD + r] > 0]
        if self.trace is not None:
            self.trace.committed(self.loop.step, participants)
        self.loop.tokens_seen += int(v[1])
        self.loop.elapsed_s += time.monotonic() - started
        self.last_step_at = time.time()
        self.first_step_at = self.first_step_at or self.last_step_at
        self._took_part(participants, v)
        self.sigtermed = int(v[3])
        return Agreed(float(v[0]) / self.replicas, int(v[1]), float(grad_norm), False, False, self.sigtermed > 0)

    def _took_part(self, participants: list[int], v) -> None:
        """Who took part, who healed, and who leads from here (the same on every replica)."""
        for r in range(self.workers):
            if v[HEAD + self.workers + r] > 0:
                heal_s = float(v[HEAD + self.workers + r])
                self.heals.append(Heal(rank=r, step=self.loop.step - 1, heal_s=heal_s, at=time.time(), lost_steps=0))
        self.healed = None
        if participants != self.participants:  # (the time: Ray shows a worker's log lines without one)
            log.warning(
                "step %d trained by replicas %s of %d (committed at %.3f)",
                self.loop.step,
                participants,
                self.workers,
                self.last_step_at,
            )
        self.participants = participants
        leader = self.leader if self.leader in participants else min(participants)
        # A replacement that healed from a peer may inherit the lead (the process it replaces led, and rejoined
        # before the others committed a step without it): it leads, but has not opened the log yet.
        if leader == self.ray_rank and (self.leader != self.ray_rank or self.metrics is None):
            self._lead()
        self.leader = leader

    def _lead(self) -> None:
        """This replica leads from now: the attempt's log reopened, every row of it written again (once)."""
        if self.metrics is None:
            Trainer.open_log(self, self.history_base)
            assert self.metrics is not None, "Trainer.open_log opens it"
            for row in self.history:
                self.metrics.append(row)
        log.info("replica %d leads (heartbeat, metrics, checkpoints) from step %d", self.ray_rank, self.loop.step)

    # -- after a step -----------------------------------------------------------------------------------------------
    def extra_columns(self) -> MetricsRow:
        return {"participants": len(self.participants), "heals": len(self.heals)}

    def after_step(self, a: Agreed) -> None:
        row, last = self.step_row(a)
        if a.preempt and preemption.requested():
            self._leave(row)
        self.log_row(row)
        if self.leader == self.ray_rank:
            if self.checkpointer.write_done():
                self.checkpointer.commit(wait=False)
            self.checkpointer.save_if_due(self.loop.step, last, self.checkpointer.time_due(), self.checkpoint_metrics())

    def _leave(self, row: MetricsRow) -> None:
        """This SIGTERMed replica leaves at this step boundary, its step committed, and is replaced live; when every
        replica of the step got one (the whole job is being stopped), the leader saves the step first."""
        self.log_row(row)
        if self.sigtermed >= len(self.participants) and self.leader == self.ray_rank:
            self.checkpoint(sync=True)
        if self.metrics is not None:
            self.metrics.flush(10.0)
        log.warning(
            "replica %d: SIGTERM: leaving after step %d (committed); replaced live", self.ray_rank, self.loop.step
        )
        preemption.checkpoint_saved()
        raise preemption.Preempted(f"replica {self.ray_rank} left at step {self.loop.step} (SIGTERM)")

    def log_row(self, row: MetricsRow) -> None:
        """Every replica keeps the row (a replica that takes the lead writes them all); the leader writes it."""
        if len(row) > 1:
            row = {**row, "time": time.time()}
            self.history.append(row)
            if self.metrics is not None and self.leads():
                self.metrics.append(row)
                log.info("step %d %s", row["step"], {k: v for k, v in row.items() if k != "step"})

    sigtermed = 0  # replicas of the last step that got SIGTERM

    def evaluate(self, rows=None) -> float:
        """The eval split's loss as an ordinary run of ``replicas`` workers computes it, on this replica alone: every
        replica knows it, whoever is missing (:func:`~.live.eval_as_replicas`)."""
        self.enter_phase("evaluating")
        t = self.cfg.train
        return eval_as_replicas(
            self.model,
            rows or self.eval_rows,
            self.replicas,
            self.device,
            self.autocast,
            t.micro_batch_size,
            t.eval_max_batches,
        )

    # -- the end ----------------------------------------------------------------------------------------------------
    def finish_checkpoints(self, done: bool) -> None:
        if self.leads():
            super().finish_checkpoints(done)
        else:
            self.checkpointer.writer.close()

    def leads(self) -> bool:
        return self.leader == self.ray_rank or (self.leader is None and self.ray_rank == 0)

    def score(self, manifest: DatasetManifest | None) -> float | None:
        return super().score(manifest) if self.leads() else None

    def export_final(self, samples: bool = False) -> str | None:
        return super().export_final(samples) if self.leads() else None

    def close(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()
        if self.heartbeat is not None:
            self.heartbeat.stop()
