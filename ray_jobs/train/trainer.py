"""The per-worker training loop: resume or start, then train steps, eval, log, checkpoint; rank 0 exports.

``worker.train_loop_per_worker`` is what Ray Train runs on each worker; :class:`Trainer` talks to the cluster only
through a :class:`~ray_jobs.train.runtime.Runtime` (tests run the same loop in-process). Checkpoints are the
:class:`~ray_jobs.checkpoint.checkpointer.Checkpointer`'s and :mod:`.resume`'s; eval, export, samples: modules beside.

Ranks must take the same decisions at the same step (checkpoint now, report a finished write, stop for a
preemption), or their collectives would deadlock: every decision is taken from one small all-reduce that ends each
step (:mod:`.agreement`). This is the native engine: another engine's trainer subclasses it, overriding only the
public hooks :class:`~ray_jobs.train.engine.EngineHooks` documents."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

from ray_jobs import checkpoint as ckpt
from ray_jobs import faults
from ray_jobs.checkpoint import LoopState, unwrap
from ray_jobs.checkpoint.checkpointer import Checkpointer, Reported
from ray_jobs.config import Config
from ray_jobs.contracts.checkpoint import CheckpointManifest
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.contracts.heartbeat import Phase
from ray_jobs.contracts.job_spec import WorkerSpec
from ray_jobs.contracts.metrics import MetricsRow
from ray_jobs.data.reading import Cursor, ShardRows, open_rows
from ray_jobs.storage import Layout
from ray_jobs.train import model as models
from ray_jobs.train import preemption, rowtrace
from ray_jobs.train.agreement import Agreed, agree
from ray_jobs.train.determinism import setup_determinism
from ray_jobs.train.eval import eval_loss, series_eval_rows, write_score
from ray_jobs.train.export import write_final
from ray_jobs.train.heartbeat import Heartbeat, start_heartbeat
from ray_jobs.train.inputs import shard_cache, train_plan
from ray_jobs.train.metrics import MetricsLog, Throughput
from ray_jobs.train.model import autocast_for, build_optimizer, clip_grads, grad_sync, to_device
from ray_jobs.train.resume import load_checkpoint, resume_agreed
from ray_jobs.train.runtime import DrainNotice, Runtime
from ray_jobs.train.samples import write_samples
from ray_jobs.train.tracking import open_trackers

log = logging.getLogger("unbroken.train")


class Trainer:
    def __init__(
        self, cfg: Config, manifest: DatasetManifest, model_path: str, rt: Runtime, heartbeat: Heartbeat | None = None
    ):
        self.cfg, self.rt, self.manifest, self.model_path = cfg, rt, manifest, model_path
        self.heartbeat = heartbeat  # rank 0's, started before this (it reports `loading` while the model loads)
        self.layout = Layout(cfg.storage)
        self.fsdp = cfg.train.parallelism == "fsdp"
        self.lora = cfg.model.lora is not None
        self.device = rt.device()
        setup_determinism(cfg, self.device)
        self._load_model_and_data()
        self.autocast = autocast_for(cfg, self.device)
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model, self.device)
        self.loop = LoopState(world_size=rt.world_size, dataset_id=manifest.dataset_id)
        self.cursors: list[Cursor] = self.plan.start()  # the global cursor: one per data rank, the same on every worker
        self.trace = rowtrace.open_trace(rt)  # test-only (None unless UNBROKEN_TRACE_ROWS is set)
        self.metrics: MetricsLog | None = None
        self.staging = ckpt.HostStaging()  # host buffers reused by every checkpoint's device-to-host copy
        self.checkpointer = Checkpointer(
            cfg, rt, self.layout.checkpoints_dir(cfg.name), self._snapshot, self.enter_phase
        )
        self.last_eval: float | None = None
        self._init_progress()
        if self.heartbeat is not None:
            self.heartbeat.attach(self)

    @classmethod
    def for_worker(cls, cfg: Config, spec: WorkerSpec, rt: Runtime, heartbeat: Heartbeat | None) -> Self:
        return cls(cfg, spec.manifest, spec.inputs.model_path, rt, heartbeat)

    def _load_model_and_data(self) -> None:
        self.cache = shard_cache(self.cfg, self.manifest)
        with ThreadPoolExecutor(1, thread_name_prefix="warm-cache") as pool:
            # This rank's shards are fetched (checksum-verified) and decoded into the node cache while the model
            # loads: the job warms its own cache, no separate Ray job before it.
            warming = pool.submit(self.load_data)
            self.model = self.build_model()
            warming.result()
        self.warmup = self.cache.counters()  # a cold cache shows misses here; a warm one, a restart's, none
        log.info("rank %d node cache warm-up: %s", self.rt.rank, self.warmup)

    def build_model(self):
        return models.build_model(self.cfg, self.model_path, self.rt)  # the hf engine's leaves the wrapping to HF

    def load_data(self) -> None:
        self.plan = train_plan(self.cfg, self.manifest, self.cache, self.rt.rank, self.rt.world_size)
        self.eval_rows = open_rows(self.cache, self.manifest.shards["eval"], self.manifest.seq_len)
        self.pad_id = self.manifest.tokenizer.pad_token_id

    def _init_progress(self) -> None:
        """What the heartbeat and the tests read of this process's progress."""
        self.rows_materialized = 0  # training rows turned into batches (resume must not build skipped ones)
        self.last_step_at = time.time()
        self.last_notice_poll = time.monotonic()  # rank 0's clock: when the ranks last asked for a drain notice
        self.notice_taken = False  # this process already checkpointed for a drain notice
        self.resumed_from: str | None = None
        self.bytes_resumed = 0  # checkpoint bytes this rank read to resume
        self.attempt = 0  # the job attempt (set from the job spec): tells a watcher whose heartbeat it reads
        self.parent: str | None = None  # the series run this one warm-started from (set from the job spec)
        self.started_step = 0  # where this process's training began; with first_step_at: time to first new step
        self.first_step_at: float | None = None
        self.throughput = Throughput()  # tokens per second since the last logged row

    # -- resume ---------------------------------------------------------------------------------------------
    def resume_or_start(self, explicit_checkpoint: str | None = None) -> None:
        """Resume from the checkpoint rank 0 picks (see :func:`~ray_jobs.train.resume.choose_resume`), else start
        fresh. Safe to run twice. If any rank finds its part bad (a truncated or corrupt file), every rank falls back
        to the previous checkpoint together."""
        self.enter_phase("loading")
        checkpoints = self.layout.checkpoints_dir(self.cfg.name)
        url, reason = resume_agreed(self.rt, checkpoints, explicit_checkpoint, self._load_checkpoint)
        if url is None:
            log.info("rank %d: no valid checkpoint, starting fresh", self.rt.rank)
        else:
            log.info(
                "rank %d: resumed from %s at step %d (%s; data at %s)",
                self.rt.rank,
                url,
                self.loop.step,
                reason,
                self.cursors,
            )
        if self.rt.rank == 0:
            self.open_log(self.loop.step if url else None)

    def open_log(self, resumed: int | None) -> None:
        """Rank 0's metrics log and trackers, keeping what was logged up to ``resumed`` (None: a fresh run)."""
        self.metrics = MetricsLog(self.layout.metrics(self.cfg.name), resumed)
        self.metrics.trackers = open_trackers(
            self.cfg,
            self.attempt,
            self.manifest.dataset_id,
            resumed,
            self.model,
            self.manifest.seq_len,
            self.rt.world_size,
            self.parent,
        )

    def _load_checkpoint(self, url: str, manifest: CheckpointManifest) -> bool:
        """Load a checkpoint every rank agreed on (:func:`~ray_jobs.train.resume.load_checkpoint`); False when a
        rank found its part bad."""
        restored, read = load_checkpoint(
            self.rt, self.cfg, url, manifest, self.model, self.optimizer, self.scheduler, self.plan.data_ranks
        )
        self.bytes_resumed = read or self.bytes_resumed
        if restored is None:
            return False
        assert restored.cursors is not None, "load_checkpoint gathers the ranks' own when the checkpoint has none"
        self.loop, self.cursors, self.last_eval = restored.loop, restored.cursors, restored.last_eval
        written_by, self.loop.world_size = self.loop.world_size, self.rt.world_size
        if written_by != self.rt.world_size and self.rt.rank == 0:
            log.warning(
                "resuming at world size %d from a checkpoint written by %d workers: each worker runs %d "
                "micro-batches per step (the global batch and the rows of every step are unchanged)",
                self.rt.world_size,
                written_by,
                self.plan.micro_batches,
            )
        self.resumed_from = url
        self.checkpointer.last_step = self.loop.step
        return True

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> LoopState:
        """Train to ``train.max_steps``; ``stop_at`` returns early after that step, as if the job died there."""
        end = self.cfg.train.max_steps if stop_at is None else min(stop_at, self.cfg.train.max_steps)
        first = self.loop.step + 1
        self.started_step, self.first_step_at = self.loop.step, None
        own_heartbeat = self._start_heartbeat()  # only when nobody started one (tests, benchmarks)
        self.eval_at_start()
        self.enter_phase("training")
        self.throughput.restart(self.loop.tokens_seen)
        preemption.training(True)
        try:
            self.train_to(end)
            self.finish_checkpoints(stop_at is None)
        finally:
            self._stop_training(own_heartbeat)
        self._log_trained(first)
        return self.loop

    def train_to(self, end: int) -> None:
        while self.loop.step < end:
            self.after_step(self.step())

    def finish_checkpoints(self, done: bool) -> None:
        if done:
            self.checkpointer.finish(self.loop.step, self.checkpoint_metrics())
        else:  # "died" here (``fit(stop_at)``): a write in flight completes (manifest and all), never reported
            self.checkpointer.stop()

    def eval_at_start(self) -> None:
        if self.loop.step == 0:
            self.last_eval = self.evaluate()
            self.log_row({"step": 0, "eval_loss": self.last_eval})

    def step(self) -> Agreed:
        """One optimizer step, its outcome agreed by every rank, and the loop state advanced."""
        faults.on_step()
        started = time.monotonic()
        return self.advance(self.agreed(*self.train_step()), started)

    def advance(self, agreed: Agreed, started: float) -> Agreed:
        """The loop state after a step every rank agreed on (started at ``started``, monotonic)."""
        self.loop.step += 1
        if self.trace is not None:
            self.trace.step_done(self.loop.step)
        self.loop.tokens_seen += agreed.tokens
        self.loop.elapsed_s += time.monotonic() - started
        self.last_step_at = time.time()
        self.first_step_at = self.first_step_at or self.last_step_at
        return agreed

    def _stop_training(self, own_heartbeat: Heartbeat | None) -> None:
        preemption.training(False)
        if self.metrics is not None and not self.metrics.flush():
            log.warning("metrics not all on storage yet: %s", self.metrics.url)
        if own_heartbeat:
            own_heartbeat.stop()
            self.heartbeat = None

    def _log_trained(self, first: int) -> None:
        if self.rt.rank != 0:
            return
        if self.loop.step >= first:
            log.info("this attempt trained steps %d..%d", first, self.loop.step)
        else:
            log.info("this attempt trained no steps (the checkpoint is already at step %d)", self.loop.step)

    def train_step(self) -> tuple[Any, int, Any]:
        """Forward/backward over ``grad_accum_steps`` micro-batches and one optimizer step (local numbers). The loss
        and the gradient norm come back as device tensors: nothing here waits for the device (on a GPU a ``.item()``
        per micro-batch drained the queue each time); ``_agree`` reads them once, after the optimizer step is queued."""
        import torch

        self.model.train()
        loss_sum, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        n = self.plan.micro_batches  # grad_accum_steps x (data ranks / world size): the global batch is kept
        for micro in range(n):
            mb = self.plan.micro_batch(self.cursors, micro, self.trace)
            self.rows_materialized += len(mb.idx)
            tokens += mb.tokens  # counted on the host, before the copy
            ids, labels, pos = (to_device(x, self.device) for x in mb.arrays)
            with grad_sync(self.model, self.fsdp, micro == n - 1), self.autocast():
                loss = models.micro_loss(self.model, ids, labels, pos, mb.learned)
            (loss / n).backward()
            loss_sum += loss.detach().to(torch.float64) / n  # float64, as the python float sum it replaces
        self.cursors = self.plan.after(self.cursors)
        grad_norm = clip_grads(self.model, self.cfg.train.max_grad_norm)  # read in _agree: no wait here
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, tokens, grad_norm

    def agreed(self, loss, tokens: int, grad_norm) -> Agreed:
        """Every rank's step outcome, agreed with one small all-reduce (:func:`~.agreement.agree`)."""
        poll_s = self.cfg.fault_tolerance.preemption_poll_s
        agreed, self.last_notice_poll = agree(
            self.rt, self.checkpointer, poll_s, self.last_notice_poll, loss, tokens, grad_norm
        )
        return agreed

    def step_row(self, a: Agreed) -> tuple[MetricsRow, bool]:
        """The step's metrics row (logged columns on log steps, the eval loss on eval steps), and whether it is the
        last step."""
        t, step = self.cfg.train, self.loop.step
        last = step == t.max_steps
        row: MetricsRow = {"step": step}
        if step % t.log_every_steps == 0 or last:
            row |= {"loss": a.loss, "grad_norm": a.grad_norm, "lr": self.scheduler.get_last_lr()[0]}
            row |= self.throughput.row(self.loop) | self.extra_columns()
        if step % t.eval_every_steps == 0 or last:
            row["eval_loss"] = self._eval_during_training()
        return row, last

    def extra_columns(self) -> MetricsRow:
        return {}  # live recovery's: who took part, who healed

    def after_step(self, a: Agreed) -> None:
        row, last = self.step_row(a)
        step = self.loop.step
        if a.write_done:
            self.checkpointer.commit(wait=False)
        if a.preempt:
            self.log_row(row)
            self._on_preemption()
        if a.notice and not last and not self.notice_taken:
            self.log_row(row)
            self._on_drain_notice(a.notice)
            return
        stall = self.checkpointer.save_if_due(step, last, a.time_due, self.checkpoint_metrics())
        if stall is not None:
            row["ckpt_stall_s"] = stall
        self.log_row(row)

    def _eval_during_training(self) -> float:
        self.last_eval = self.evaluate()
        self.enter_phase("training")
        if self.loop.best_eval_loss is None or self.last_eval < self.loop.best_eval_loss:
            self.loop.best_eval_loss = self.last_eval
        return self.last_eval

    # -- preemption -----------------------------------------------------------------------------------------
    def _on_preemption(self) -> None:
        """A rank got SIGTERM: a just-in-time checkpoint on every rank, then every rank raises."""
        preemption.checkpoint_and_raise(lambda: self.checkpoint(sync=True), self.rt.rank, self.loop.step)

    def _on_drain_notice(self, notice: DrainNotice) -> None:
        """A node of this group is being drained: checkpoint this step now (unless it just was), on every rank, then
        wait for Ray Train to restart the group without that node (:func:`~.preemption.checkpoint_and_wait`)."""
        self.notice_taken = True
        taken = self.checkpointer.last_step == self.loop.step and self.checkpointer.pending is None
        save = (lambda: 0.0) if taken else (lambda: self.checkpoint(sync=True))
        preemption.checkpoint_and_wait(
            notice, save, self.rt.rank, self.loop.step, self.cfg.fault_tolerance.preemption_grace_s, self.enter_phase
        )

    # -- checkpoints: when and how is the checkpointer's; what is in one is the trainer's --------------------
    def checkpoint(self, sync: bool) -> float:
        """Take a checkpoint of this step now; returns the seconds training was blocked."""
        return self.checkpointer.save(self.loop.step, self.checkpoint_metrics(), sync)

    def checkpoint_metrics(self) -> Reported:
        """What Ray Train is told with a checkpoint (``checkpoint.keep_best_by`` ranks by these)."""
        return {"step": self.loop.step, "eval_loss": self.last_eval}

    def _snapshot(self) -> ckpt.Part:
        """This rank's part of the checkpoint as host copies (the device-to-host copy is all training waits for)."""
        r = self.rt.rank
        files: dict[str, tuple[str, Any]] = {ckpt.rank_file(r): ("json", ckpt.rank_state(self.cursors[r]))}
        files |= ckpt.tensor_files(r, self.model, self.optimizer, self.staging, self.fsdp, self.lora)
        if r == 0:
            state = ckpt.loop_state_file(
                self.loop, self.scheduler, self.last_eval, self.cfg, self.plan.data_ranks, self.cursors
            )
            files[ckpt.STATE_FILE] = ("json", state)
        return ckpt.Part(self.loop.step, files, ready=self.staging.ready())

    # -- measuring ------------------------------------------------------------------------------------------
    def evaluate(self, rows: ShardRows | None = None) -> float:
        """Mean loss per target token over the eval split (or ``rows``), every rank reading its own slice."""
        self.enter_phase("evaluating")
        model = self.model if self.fsdp else unwrap(self.model)
        t = self.cfg.train
        return eval_loss(
            model, rows or self.eval_rows, self.rt, self.device, self.autocast, t.micro_batch_size, t.eval_max_batches
        )

    def log_row(self, row: MetricsRow) -> None:
        if self.metrics is not None and len(row) > 1:
            self.metrics.append({**row, "time": time.time()})
            log.info("step %d %s", row["step"], {k: v for k, v in row.items() if k != "step"})

    def _start_heartbeat(self) -> Heartbeat | None:
        """A heartbeat of its own when the caller started none (rank 0 only); returned so ``fit`` stops it."""
        if self.rt.rank != 0 or self.heartbeat is not None:
            return None
        self.heartbeat = start_heartbeat(self.cfg, self.attempt)
        self.heartbeat.attach(self)
        return self.heartbeat

    def enter_phase(self, phase: Phase) -> None:
        """Enter a phase: rank 0's heartbeat says so at once (watchers judge a stall by the phase's limit)."""
        if self.heartbeat is not None:
            self.heartbeat.enter(phase)
        faults.on_phase(phase)

    # -- the end --------------------------------------------------------------------------------------------
    def score(self, manifest: DatasetManifest | None) -> float | None:
        """The trained model's loss on a series' pinned eval set (another staged dataset's eval split, the same for
        every run of the series); rank 0 writes it to ``runs/<run>/score.json`` for the promotion gate."""
        if not manifest:
            return None
        loss = self.evaluate(series_eval_rows(self.cfg, manifest))
        if self.rt.rank == 0:
            write_score(self.layout.score(self.cfg.name), manifest.dataset_id, loss, self.loop.step)
        return loss

    def export_final(self, samples: bool = False) -> str | None:
        """``runs/<run>/final``, then (``samples``) the sample generations: all in ``exporting`` (a kill then is no done)."""
        self.enter_phase("exporting")
        url = write_final(self.cfg, self.rt, self.model, self.model_path, self.manifest, self.loop, self.metrics)
        if url is not None:
            if samples:  # from the staged eval split; a failure there is a warning, never a failed run
                write_samples(self.cfg, self.model_path, url, self.eval_rows, self.manifest, self.device)
            self.enter_phase("done")
        return url

    def close(self) -> None:
        """Nothing to release here (the worker stops the heartbeat it started)."""
