"""The per-worker training loop: resume or start, then train steps, eval, log, checkpoint; rank 0 exports.

``train_loop_per_worker`` is what Ray Train runs on each worker; :class:`Trainer` holds everything and talks
to the cluster only through a :class:`~ray_jobs.train.runtime.Runtime`, so tests run the same loop in-process.

Ranks must take the same decisions at the same step (checkpoint now, report a finished write, stop for a
preemption), or their collectives would deadlock. Each step therefore ends with one small all-reduce of the loss,
the token count and three flags; every decision is taken from that agreed vector only.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_jobs import checkpoint as ckpt
from ray_jobs.checkpoint import LoopState, unwrap
from ray_jobs.config import Config, from_json
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import Cursor, ShardRows, StepPlan, open_rows
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.storage import Layout, upload_dir, write_json_atomic
from ray_jobs.train import faults, preemption, rowtrace
from ray_jobs.train.heartbeat import Heartbeat
from ray_jobs.train.metrics import MetricsLog
from ray_jobs.train.model import build_model, export_model, finish_in_place, write_sharded_export
from ray_jobs.train.runtime import Runtime

log = logging.getLogger("unbroken.train")
IGNORE_INDEX = -100


def determinism_settings(deterministic: bool, device_type: str) -> dict[str, Any]:
    """What :func:`setup_determinism` sets for ``train.deterministic`` on a ``device_type`` ("cuda" or "cpu")."""
    out: dict[str, Any] = {"deterministic_algorithms": deterministic, "env": {}}
    if device_type == "cuda":
        # cuBLAS picks its reduction workspace per stream unless told a fixed one; read at its first call.
        out["env"] = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if deterministic else {}
        out["cudnn_deterministic"], out["cudnn_benchmark"] = deterministic, not deterministic
    return out


def setup_determinism(cfg: Config, device) -> None:
    """Same seed + same world size = same weights: fixed seeds and thread count; with ``train.deterministic`` also
    deterministic kernels (else the fastest ones: autotuned cuDNN). Runs before the model touches the device."""
    import random

    import numpy as np
    import torch

    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    settings = determinism_settings(cfg.train.deterministic, device.type)
    for key, value in settings["env"].items():
        os.environ.setdefault(key, value)  # a value the user set (e.g. ":16:8", also deterministic) is kept
    torch.use_deterministic_algorithms(settings["deterministic_algorithms"])
    if "cudnn_benchmark" in settings:
        torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]


@dataclass
class Agreed:
    """One step's outcome as every rank sees it (the result of the per-step all-reduce)."""

    loss: float
    tokens: int
    grad_norm: float  # this rank's (identical on every rank after the gradient all-reduce)
    write_done: bool
    time_due: bool
    preempt: bool  # a rank got SIGTERM
    notice: dict[str, Any] | None = None  # Ray Train's drain notice for a node of this group (when polled)


class Trainer:
    def __init__(
        self, cfg: Config, manifest: dict[str, Any], model_path: str, rt: Runtime, heartbeat: Heartbeat | None = None
    ):
        import torch
        from transformers import get_scheduler

        self.cfg, self.rt, self.manifest, self.model_path = cfg, rt, manifest, model_path
        self.heartbeat = heartbeat  # rank 0's, started before this (it reports `loading` while the model loads)
        self.layout = Layout(cfg.storage)
        self.fsdp = cfg.train.parallelism == "fsdp"
        self.lora = cfg.model.lora is not None
        self.device = rt.device()
        setup_determinism(cfg, self.device)
        self.cache = ShardCache(cfg.storage, manifest["dataset_id"], cfg.data.cache_dir, cfg.data.cache_max_gb * 1e9)
        with ThreadPoolExecutor(1, thread_name_prefix="warm-cache") as pool:
            # This rank's shards are fetched (checksum-verified) and decoded into the node cache while the model
            # loads: the job warms its own cache, no separate Ray job before it.
            warming = pool.submit(self._load_data)
            self.model = build_model(cfg, model_path, rt)
            warming.result()
        self.warmup = self.cache.counters()  # a cold cache shows misses here; a warm one, a restart's, none
        log.info("rank %d node cache warm-up: %s", rt.rank, self.warmup)
        bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and self.device.type == "cuda")
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        )
        t = cfg.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        # On a GPU the fused AdamW (one kernel for every parameter's update, fp32 moments as the parameters); on a
        # CPU the default, whose bits the CPU resume guarantees were shown with.
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, **fused)
        self.scheduler = get_scheduler(t.lr_schedule, self.optimizer, t.warmup_steps, t.max_steps)
        self.loop = LoopState(world_size=rt.world_size, dataset_id=manifest["dataset_id"])
        self.cursors = self.plan.start()  # the global cursor: one per data rank, the same on every worker
        self.trace = rowtrace.open_trace(rt)  # test-only (None unless UNBROKEN_TRACE_ROWS is set)
        self.metrics: MetricsLog | None = None
        self.writer = ckpt.AsyncWriter()
        self.staging = ckpt.HostStaging()  # host buffers reused by every checkpoint's device-to-host copy
        self.pending: tuple[int, dict[str, Any]] | None = None  # started, not yet reported (known to all ranks)
        self.manifest_pending = False  # the parts landed; rank 0's manifest write is in flight
        self.last_eval: float | None = None
        self.last_checkpoint_step = -1
        self.last_checkpoint_time = time.monotonic()
        self.checkpoint_owed = False  # one is due but waits for the previous write to land
        self.stalls_s: list[float] = []  # training-thread time blocked per checkpoint
        self.rows_materialized = 0  # training rows turned into batches (resume must not build skipped ones)
        self.last_step_at = time.time()
        self.last_notice_poll = time.monotonic()  # rank 0's clock: when the ranks last asked for a drain notice
        self.notice_taken = False  # this process already checkpointed for a drain notice
        self.tokens_per_s = 0.0
        self.resumed_from: str | None = None
        self.bytes_resumed = 0  # checkpoint bytes this rank read to resume
        self.attempt = 0  # the job attempt (set from the job spec): tells a watcher whose heartbeat it reads
        self.started_step = 0  # where this process's training began; with first_step_at: time to first new step
        self.first_step_at: float | None = None
        self._window = (time.monotonic(), 0)
        if self.heartbeat is not None:
            self.heartbeat.attach(self)

    def _load_data(self) -> None:
        seq_len, t = self.manifest["seq_len"], self.cfg.train
        # Laid out for cluster.num_workers' max whatever the world size now (reading.StepPlan): rows memory-mapped,
        # read as batches take them. Position ids restart per packed example: with them (and no KV cache) the model
        # attends within examples only.
        self.plan = StepPlan(self.cache, self.manifest["shards"]["train"], seq_len,
                             data_ranks=self.cfg.cluster.max_workers, grad_accum_steps=t.grad_accum_steps,
                             micro_batch_size=t.micro_batch_size, seed=t.seed, rank=self.rt.rank,
                             world_size=self.rt.world_size)  # fmt: skip
        self.eval_rows = open_rows(self.cache, self.manifest["shards"]["eval"], seq_len)
        self.pad_id = self.manifest["tokenizer"]["pad_token_id"]

    # -- resume ---------------------------------------------------------------------------------------------
    def resume_or_start(self, explicit_checkpoint: str | None = None) -> None:
        """Resume from the checkpoint rank 0 picks (see :func:`choose_resume`), else start fresh. Safe to run twice.

        One decision per start, made once and broadcast: if each rank picked its own "newest valid", one slow or
        throttled read could send one rank to an older checkpoint, and the ranks would diverge or deadlock. The
        choice reads manifests only; each rank then reads and verifies the shared files and its own part. If any
        rank finds one bad (a truncated or corrupt file), every rank falls back to the previous checkpoint together."""
        self._phase("loading")
        refused: list[str] = []
        while True:
            choice: tuple[str | None, str, dict | None] = (None, "", None)
            if self.rt.rank == 0:
                try:
                    choice = choose_resume(self.layout.checkpoints_dir(self.cfg.name), explicit_checkpoint,
                                           refused=refused)  # fmt: skip
                except ckpt.CheckpointInvalid as e:
                    choice = (None, f"error: {e}", None)
                except Exception as e:  # every rank must hear of it, or the others wait in the broadcast
                    choice = (None, f"failed: {type(e).__name__}: {e}", None)
            url, reason, manifest = self.rt.broadcast_object(choice)
            if reason.startswith("error: "):
                raise ckpt.CheckpointInvalid(reason.removeprefix("error: "))
            if reason.startswith("failed: "):
                raise RuntimeError(f"choosing a checkpoint to resume from {reason}")
            if url is None or self._load_checkpoint(url, manifest):
                break
            log.warning("checkpoint %s: a rank found its part bad; every rank falls back to the previous one", url)
            if self.rt.rank == 0:
                ckpt.refuse(url)  # so no later start (nor the watchdog) picks it again
            refused.append(url)
        if url is None:
            log.info("rank %d: no valid checkpoint, starting fresh", self.rt.rank)
        else:
            log.info("rank %d: resumed from %s at step %d (%s; data at %s)", self.rt.rank, url, self.loop.step,
                     reason, self.cursors)  # fmt: skip
        if self.rt.rank == 0:
            self.metrics = MetricsLog(self.layout.metrics(self.cfg.name), self.loop.step if url else None)

    def _load_checkpoint(self, url: str, manifest: dict[str, Any]) -> bool:
        """Read, verify and load this rank's part of a checkpoint, every rank deciding together (collectives):
        False when some rank found its part bad (all fall back); an error that is not the checkpoint's fault (a
        read that failed, a checkpoint that does not fit this run) fails every rank, never a silent step back."""
        files, bad, failed = None, 0.0, ""
        try:
            names = ckpt.rank_files(manifest, self.rt.rank, manifest.get("world_size") != self.rt.world_size)
            files = ckpt.read_files(url, manifest, names)
            self.bytes_resumed = sum(len(d) for d in files.values())
        except ckpt.CheckpointInvalid as e:
            log.warning("rank %d: checkpoint %s: %s", self.rt.rank, url, e)
            bad = 1.0
        except Exception as e:
            failed = f"rank {self.rt.rank} could not read checkpoint {url}: {type(e).__name__}: {e}"
        self._together(failed)
        if self.rt.all_reduce_sum([bad])[0] > 0:
            return False
        try:
            self._restore(files, manifest)
        except Exception as e:
            failed = f"rank {self.rt.rank} could not load checkpoint {url}: {type(e).__name__}: {e}"
        self._together(failed)
        if self.cursors is None:  # a checkpoint from before the global cursor: each rank held its own
            self.cursors = [Cursor(**c) for c in self.rt.all_gather_object(self._own_cursor)]
        written_by, self.loop.world_size = self.loop.world_size, self.rt.world_size
        if written_by != self.rt.world_size and self.rt.rank == 0:
            log.warning("resuming at world size %d from a checkpoint written by %d workers: each worker runs %d "
                        "micro-batches per step (the global batch and the rows of every step are unchanged)",
                        self.rt.world_size, written_by, self.plan.micro_batches)  # fmt: skip
        self.resumed_from = url
        self.last_checkpoint_step = self.loop.step
        return True

    def _together(self, failed: str) -> None:
        """Raise on every rank if ``failed`` (a message) is set on any (a collective every rank enters)."""
        if self.rt.all_reduce_sum([float(bool(failed))])[0] > 0:
            reasons = [r for r in self.rt.all_gather_object(failed) if r]
            raise RuntimeError("; ".join(reasons))

    def _restore(self, files: dict[str, bytes], manifest: dict[str, Any]) -> None:
        import torch
        from safetensors.torch import load

        state = json.loads(files[ckpt.STATE_FILE])
        loop = LoopState(**state["loop"])
        data = state.get("data") or {"data_ranks": loop.world_size}  # older checkpoints: one data rank per worker
        if data["data_ranks"] != self.plan.data_ranks:
            raise ckpt.CheckpointInvalid(
                f"its data is laid out for {data['data_ranks']} workers, this run's for {self.plan.data_ranks}; "
                f"resume with cluster.num_workers (its max, if elastic) = {data['data_ranks']}"
            )
        if "cursors" not in data and loop.world_size != self.rt.world_size:
            raise ckpt.CheckpointInvalid(
                f"written by {loop.world_size} workers before checkpoints held a global data cursor; resume it with "
                f"{loop.world_size} workers"
            )
        if manifest.get("sharded", False) != self.fsdp and manifest["format"] > 1:
            raise ckpt.CheckpointInvalid(
                f"written with train.parallelism={'fsdp' if manifest.get('sharded') else 'ddp'}; resume with the same"
            )
        r = self.rt.rank
        if manifest["format"] > 1 and self.fsdp and loop.world_size != self.rt.world_size:  # every rank's shards
            shared = load(files[ckpt.MODEL_FILE]) if ckpt.MODEL_FILE in files else {}
            parts = range(loop.world_size)
            ckpt.load_resharded_model_state(self.model, [load(files[ckpt.model_part(k)]) for k in parts], shared,
                                            self.lora)  # fmt: skip
            optims = [torch.load(io.BytesIO(files[ckpt.optim_part(k)]), weights_only=True) for k in parts]
            ckpt.load_resharded_optimizer_state(self.optimizer, optims)
        elif manifest["format"] > 1 and self.fsdp:  # this rank's own shards only
            shared = load(files[ckpt.MODEL_FILE]) if ckpt.MODEL_FILE in files else {}
            ckpt.load_sharded_model_state(self.model, load(files[ckpt.model_part(r)]), shared, self.lora)
            osd = torch.load(io.BytesIO(files[ckpt.optim_part(r)]), weights_only=True)
            ckpt.load_sharded_optimizer_state(self.optimizer, osd)
        else:
            model_sd, optim_sd, _ = ckpt.decode(files)
            ckpt.load_model_state(self.model, model_sd, self.fsdp, self.lora)
            ckpt.load_optimizer_state(self.model, self.optimizer, optim_sd, self.fsdp)
        self.scheduler.load_state_dict(state["scheduler"])
        self.loop = loop
        if manifest["format"] == 1:
            mine = state["ranks"][r]
        elif ckpt.rank_file(r) in files:
            mine = json.loads(files[ckpt.rank_file(r)])
        else:  # a rank the checkpoint's smaller world did not have: its RNG streams start from the seed
            mine = None
        if "cursors" in data:
            self.cursors = [Cursor(**c) for c in data["cursors"]]
        else:
            self.cursors, self._own_cursor = None, mine["cursor"]  # gathered once every rank loaded
        if mine is not None:
            ckpt.set_rng_state(mine["rng"])
        self.last_eval = state.get("last_eval_loss")

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> LoopState:
        """Train to ``train.max_steps``; ``stop_at`` returns early after that step, as if the job died there."""
        end = self.cfg.train.max_steps if stop_at is None else min(stop_at, self.cfg.train.max_steps)
        first = self.loop.step + 1
        self.started_step, self.first_step_at = self.loop.step, None
        own_heartbeat = self._start_heartbeat()  # only when nobody started one (tests, benchmarks)
        if self.loop.step == 0:
            self.last_eval = self.evaluate()
            self._log({"step": 0, "eval_loss": self.last_eval})
        self._phase("training")
        self._window = (time.monotonic(), self.loop.tokens_seen)
        preemption.training(True)
        try:
            while self.loop.step < end:
                faults.on_step()
                started = time.monotonic()
                agreed = self._agree(*self.train_step())
                self.loop.step += 1
                if self.trace is not None:
                    self.trace.step_done(self.loop.step)
                self.loop.tokens_seen += agreed.tokens
                self.loop.elapsed_s += time.monotonic() - started
                self.last_step_at = time.time()
                self.first_step_at = self.first_step_at or self.last_step_at
                self._after_step(agreed)
            if stop_at is None:
                self._finish()
            else:  # "died" here: a write in flight completes (manifest and all), but is never reported
                if self.pending is not None:
                    self._report_pending(report=False)
                self.writer.close()
        finally:
            preemption.training(False)
            if self.metrics is not None and not self.metrics.flush():
                log.warning("metrics not all on storage yet: %s", self.metrics.url)
            if own_heartbeat:
                own_heartbeat.stop()
                self.heartbeat = None
        if self.rt.rank == 0:
            if self.loop.step >= first:
                log.info("this attempt trained steps %d..%d", first, self.loop.step)
            else:
                log.info("this attempt trained no steps (the checkpoint is already at step %d)", self.loop.step)
        return self.loop

    def train_step(self) -> tuple[Any, int, Any]:
        """Forward/backward over ``grad_accum_steps`` micro-batches and one optimizer step (local numbers). The loss
        and the gradient norm come back as device tensors: nothing here waits for the device (on a GPU a ``.item()``
        per micro-batch drained the queue each time); ``_agree`` reads them once, after the optimizer step is queued."""
        import torch

        self.model.train()
        loss_sum, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        n = self.plan.micro_batches  # grad_accum_steps x (data ranks / world size): the global batch is kept
        for micro in range(n):
            v, idx, epochs = self.plan.batch(self.cursors, micro)
            self.rows_materialized += len(idx)
            if self.trace is not None:
                self.trace.add(epochs, self.plan.identify(v, idx))
            arrays = self.plan.take(v, idx)
            tokens += int((arrays[0] != self.pad_id).sum())  # counted on the host, before the copy
            ids, labels, pos = (self._to_device(x) for x in arrays)
            with self._grad_sync(micro == n - 1), self.autocast():
                # use_cache=False: transformers ignores packed position_ids while it builds a KV cache
                loss = self.model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
            (loss / n).backward()
            loss_sum += loss.detach().to(torch.float64) / n  # float64, as the python float sum it replaces
        self.cursors = self.plan.after(self.cursors)
        grad_norm = self._clip()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, tokens, grad_norm

    def _to_device(self, x: np.ndarray):
        """A batch array on the training device: on a GPU through pinned memory, asynchronously (a copy from pageable
        memory synchronizes the stream first: the GPU would idle at every micro-batch)."""
        import torch

        t = torch.from_numpy(x)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _grad_sync(self, sync: bool):
        """Gradients are all-reduced only on the last micro-batch of an accumulation."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if sync or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _clip(self) -> float:
        import torch

        max_norm = self.cfg.train.max_grad_norm or float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # read in _agree: no wait here

    def _agree(self, loss, tokens: int, grad_norm) -> Agreed:
        """Every rank's step outcome, agreed with one small all-reduce; the step's only wait for the device."""
        loss, grad_norm = float(loss), float(grad_norm)
        rank0 = self.rt.rank == 0
        every_min = self.cfg.checkpoint.every_minutes
        time_due = rank0 and every_min > 0 and time.monotonic() - self.last_checkpoint_time >= every_min * 60
        write_done = self.pending is not None and self.writer.done()  # this rank's part is on storage
        poll_due = rank0 and time.monotonic() - self.last_notice_poll >= self.cfg.fault_tolerance.preemption_poll_s
        flags = [float(write_done), float(time_due), float(preemption.requested()), float(poll_due)]
        v = self.rt.all_reduce_sum([loss, tokens, *flags])
        notice = None
        if v[5] > 0:  # Ray Train's notice is itself a barrier: asked only every preemption_poll_s, by every rank
            self.last_notice_poll = time.monotonic()
            notice = self.rt.preemption_notice()
        every_part = v[2] >= self.rt.world_size
        return Agreed(v[0] / self.rt.world_size, int(v[1]), grad_norm, every_part, v[3] > 0, v[4] > 0, notice)

    def _after_step(self, a: Agreed) -> None:
        t, step = self.cfg.train, self.loop.step
        last = step == t.max_steps
        row: dict[str, Any] = {"step": step}
        if step % t.log_every_steps == 0 or last:
            row |= {"loss": a.loss, "grad_norm": a.grad_norm, "lr": self.scheduler.get_last_lr()[0]}
            row |= self._throughput()
        if step % t.eval_every_steps == 0 or last:
            row["eval_loss"] = self.last_eval = self.evaluate()
            self._phase("training")
            if self.loop.best_eval_loss is None or self.last_eval < self.loop.best_eval_loss:
                self.loop.best_eval_loss = self.last_eval
        if a.write_done:
            self._report_pending(wait=False)
        if a.preempt:
            self._log(row)
            self.checkpoint(sync=True)
            log.warning("rank %d: just-in-time checkpoint at step %d saved (preemption)", self.rt.rank, step)
            preemption.checkpoint_saved()
            raise preemption.Preempted(f"preempted: just-in-time checkpoint at step {step} saved")
        if a.notice and not last and not self.notice_taken:
            self._log(row)
            self._on_drain_notice(a.notice)
            return
        every = self.cfg.checkpoint.every_steps
        was_owed = self.checkpoint_owed
        self.checkpoint_owed |= not last and bool((every and step % every == 0) or a.time_due)
        if self.checkpoint_owed and self.pending is not None:
            # The previous write is still in flight (a slow or unavailable store): keep training and take this
            # checkpoint at the first step after it landed, instead of freezing every rank until it does. Every
            # rank knows: ``pending`` is cleared on all ranks together once rank 0 says the write is done.
            if not was_owed and self.rt.rank == 0:
                log.warning("checkpoint due at step %d deferred: the previous write is still in flight", step)
        elif self.checkpoint_owed:
            row["ckpt_stall_s"] = self.checkpoint(sync=not self.cfg.checkpoint.async_write)
        self._log(row)

    def _on_drain_notice(self, notice: dict[str, Any]) -> None:
        """A node of this group is being drained (a spot reclaim, ``ray drain-node``): checkpoint this step now, on
        every rank, then wait for Ray Train to restart the group without that node.

        Ray Train restarts once the drain deadline passes (or 120 s after the notice, without one) and counts it
        against ``FailureConfig.max_preemption_failures``, not ``max_failures``. It must be waited for, not forced:
        a rank that raised would count as a failure, one that returned as the run's success. Training on would only
        make steps that the restart throws away; waiting loses none."""
        step = self.loop.step
        self.notice_taken = True
        if self.last_checkpoint_step != step or self.pending is not None:
            self.checkpoint(sync=True)
        deadline = notice["deadline_ms"] / 1000 if notice.get("deadline_ms") else time.time() + 120
        log.warning("rank %d: just-in-time checkpoint at step %d saved (drain notice for node(s) %s, deadline in "
                    "%.0f s); waiting for Ray Train to restart the group", self.rt.rank, step,
                    ", ".join(n[:12] for n in notice.get("nodes", {})), deadline - time.time())  # fmt: skip
        self._phase("preempted")
        give_up = deadline + self.cfg.fault_tolerance.preemption_grace_s + 60
        while time.time() < give_up:
            time.sleep(0.5)
        # Still here long past the deadline: the drain went nowhere. Carry on rather than idle for ever.
        log.warning("rank %d: no restart %.0f s past the drain deadline; training on", self.rt.rank, give_up - deadline)
        self._phase("training")

    def _finish(self) -> None:
        """The last step is always checkpointed, synchronously, and every started write is reported."""
        if self.last_checkpoint_step != self.loop.step:
            self.checkpoint(sync=True)
            if self.checkpoint_owed:  # abandoned (a store refused a write): the attempt fails, and is retried
                raise RuntimeError(f"the final checkpoint (step {self.loop.step}) could not be written")
        elif self.pending is not None:
            self._report_pending()
        self.writer.close()

    # -- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint(self, sync: bool) -> float:
        """Snapshot state into host memory and hand it to the writer; returns the seconds training was blocked."""
        started = time.monotonic()
        if sync:
            self._phase("checkpointing")  # the training thread waits for the write: not a training step's time
        if self.pending is not None:  # at most one write in flight: finish (and report) the previous one first
            self._report_pending()
        self.writer.submit(self._snapshot(), self._checkpoint_url(self.loop.step))  # every rank writes its part
        self.pending = (self.loop.step, {"step": self.loop.step, "eval_loss": self.last_eval})
        self.manifest_pending = False
        self.last_checkpoint_step = self.loop.step
        self.last_checkpoint_time = time.monotonic()
        self.checkpoint_owed = False
        if sync:
            self._report_pending()
            self._phase("training")
        stall = time.monotonic() - started
        self.stalls_s.append(stall)
        return stall

    def _checkpoint_url(self, step: int) -> str:
        from ray_jobs.storage import join

        return join(self.layout.checkpoints_dir(self.cfg.name), ckpt.checkpoint_name(step))

    def _snapshot(self) -> ckpt.Part:
        """This rank's part of the checkpoint as host copies (the device-to-host copy is all training waits for)."""
        r, files = self.rt.rank, {}
        files[ckpt.rank_file(r)] = ("json", ckpt.rank_state(self.cursors[r]))  # its data rank's, as before
        if self.fsdp:  # each rank its own shards, nothing gathered
            local, replicated = ckpt.sharded_model_state(self.model, self.lora, self.staging)
            files[ckpt.model_part(r)] = ("safetensors", local)
            files[ckpt.optim_part(r)] = ("torch", ckpt.sharded_optimizer_state(self.optimizer, self.staging))
            if r == 0 and replicated:
                files[ckpt.MODEL_FILE] = ("safetensors", replicated)
        elif r == 0:  # DDP: the weights and optimizer state are the same on every rank: written once
            files[ckpt.MODEL_FILE] = ("safetensors", ckpt.model_state(self.model, False, self.lora, self.staging))
            files[ckpt.OPTIM_FILE] = ("torch", ckpt.optimizer_state(self.model, self.optimizer, False, self.staging))
        if r == 0:
            state = {
                "loop": asdict(self.loop),
                "scheduler": self.scheduler.state_dict(),
                "last_eval_loss": self.last_eval,
                "config": json.loads(self.cfg.model_dump_json()),
                # the global cursor: where every data rank is, so any world size resumes on the same rows
                "data": {"data_ranks": self.plan.data_ranks, "cursors": [asdict(c) for c in self.cursors]},
            }
            files[ckpt.STATE_FILE] = ("json", state)
        return ckpt.Part(self.loop.step, files, ready=self.staging.ready())

    def _report_pending(self, report: bool = True, wait: bool = True) -> None:
        """Finish the checkpoint in flight, every rank together, in two stages that each end at a step boundary:
        once every rank's part landed, rank 0 writes the manifest (on the writer's thread: training never waits on
        storage); once that landed, all report the checkpoint to Ray. ``wait`` runs both stages now."""
        if not self.manifest_pending:
            self._parts_landed()
            if not (wait and self.manifest_pending):
                return
        self._manifest_landed(report)

    def _parts_landed(self) -> None:
        step, _ = self.pending
        try:
            written = self.writer.collect()
        except Exception as e:  # this rank's part did not land: no rank may declare the checkpoint written
            log.warning("rank %d: checkpoint for step %d not written: %s: %s", self.rt.rank, step, type(e).__name__, e)
            written = None
        parts = self.rt.all_gather_object(written)
        if any(p is None for p in parts):
            self._abandon(step, "a rank's part failed")
            return
        if self.rt.rank == 0:
            self.writer.run(ckpt.write_manifest, self._checkpoint_url(step), step, self.rt.world_size, self.fsdp, parts)
        self.manifest_pending = True

    def _manifest_landed(self, report: bool) -> None:
        step, metrics = self.pending
        landed = True
        if self.rt.rank == 0:
            try:
                self.writer.collect()
                log.info("checkpoint for step %d written: %s", step, self._checkpoint_url(step))
            except Exception as e:  # the store refused the manifest: the checkpoint does not exist, on every rank
                log.warning("rank 0: manifest for step %d not written: %s: %s", step, type(e).__name__, e)
                landed = False
        if not self.rt.broadcast_object(landed):
            self._abandon(step, "its manifest could not be written")
            return
        self.pending, self.manifest_pending = None, False
        if report:
            self.rt.report(metrics, self._checkpoint_url(step) if self.rt.rank == 0 else None)

    def _abandon(self, step: int, why: str) -> None:
        log.warning("checkpoint for step %d abandoned (%s); the next step takes one", step, why)
        self.pending, self.manifest_pending, self.checkpoint_owed = None, False, True

    # -- measuring ------------------------------------------------------------------------------------------
    def _throughput(self) -> dict[str, float]:
        now = time.monotonic()
        t0, tok0 = self._window
        self._window = (now, self.loop.tokens_seen)
        self.tokens_per_s = round((self.loop.tokens_seen - tok0) / max(now - t0, 1e-9), 1)
        return {
            "tokens_seen": self.loop.tokens_seen,
            "tokens_per_s": self.tokens_per_s,
            "elapsed_s": self.loop.elapsed_s,
        }

    def evaluate(self, rows: ShardRows | None = None) -> float:
        """Mean loss per target token over the eval split (or ``rows``); each rank reads only its slice of the rows
        (every ``world_size``-th), and all run equally many batches."""
        import torch

        self._phase("evaluating")
        rows = rows or self.eval_rows
        mine = np.arange(self.rt.rank, len(rows), self.rt.world_size)
        mb = self.cfg.train.micro_batch_size
        per_rank = -(-len(rows) // self.rt.world_size)
        batches = -(-per_rank // mb)
        if self.cfg.train.eval_max_batches:
            batches = min(batches, self.cfg.train.eval_max_batches)
        model = self.model if self.fsdp else unwrap(self.model)
        model.eval()
        loss_sum, count = 0.0, 0
        with torch.no_grad(), self.autocast():
            for b in range(batches):
                lo = b * mb
                real = lo < len(mine)  # a rank out of rows runs a throwaway batch so collectives stay in step
                x, y, p = (
                    torch.from_numpy(a).to(self.device)
                    for a in rows.take(mine[lo : lo + mb] if real else np.arange(min(mb, len(rows))))
                )
                loss = model(input_ids=x, labels=y, position_ids=p, use_cache=False).loss.item()
                if real:
                    n = int((y[:, 1:] != IGNORE_INDEX).sum())
                    loss_sum, count = loss_sum + loss * n, count + n
        loss_sum, count = self.rt.all_reduce_sum([loss_sum, float(count)])
        return loss_sum / max(count, 1.0)

    def _log(self, row: dict[str, Any]) -> None:
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

    def _phase(self, phase: str) -> None:
        """Enter a phase: rank 0's heartbeat says so at once (watchers judge a stall by the phase's limit)."""
        if self.heartbeat is not None:
            self.heartbeat.enter(phase)
        faults.on_phase(phase)

    # -- the end --------------------------------------------------------------------------------------------
    def score(self, manifest: dict[str, Any] | None) -> float | None:
        """The trained model's loss on a series' pinned eval set (another staged dataset's eval split, the same for
        every run of the series); rank 0 writes it to ``runs/<run>/score.json`` for the promotion gate."""
        if not manifest:
            return None
        cache = ShardCache(self.cfg.storage, manifest["dataset_id"], self.cfg.data.cache_dir,
                           self.cfg.data.cache_max_gb * 1e9)  # fmt: skip
        loss = self.evaluate(open_rows(cache, manifest["shards"]["eval"], manifest["seq_len"]))
        if self.rt.rank == 0:
            body = {"dataset_id": manifest["dataset_id"], "eval_loss": loss, "step": self.loop.step}
            write_json_atomic(self.layout.score(self.cfg.name), body)
            log.info("score on the series' eval set %s: %.4f", manifest["dataset_id"], loss)
        return loss

    def export_final(self) -> str | None:
        """The final HF folder (merged weights in ``train.export_dtype``, tokenizer, model card) at
        ``runs/<run>/final``, made from the trained model itself: in place under DDP (rank 0), gathered a tensor at
        a time under FSDP (every rank joins, rank 0 writes); only FSDP + LoRA still builds a second model to merge."""
        self._phase("exporting")
        url = self.layout.final_model(self.cfg.name)
        with tempfile.TemporaryDirectory(prefix="unbroken-final-") as d:
            if self.fsdp and not self.lora:
                write_sharded_export(self.cfg, self.model_path, self.model, self.rt.rank, d)
            elif self.fsdp:
                state = ckpt.model_state(self.model, True, True)  # the adapters only: small, gathered
                if self.rt.rank == 0:
                    self._save(export_model(self.cfg, self.model_path, state), d)
            elif self.rt.rank == 0:
                self._save(finish_in_place(self.cfg, self.model_path, unwrap(self.model)), d)
            if self.rt.rank != 0:
                return None
            load_tokenizer(self.model_path, self.cfg.data.cache_dir).save_pretrained(d)
            (Path(d) / "README.md").write_text(model_card(self.cfg, self.manifest, self.loop, self.metrics))
            upload_dir(d, url)
        log.info("final model written to %s", url)
        self._phase("done")
        return url

    def _save(self, model, folder: str) -> None:
        model.save_pretrained(folder, max_shard_size=f"{self.cfg.train.export_shard_mb}MB")


def model_card(cfg: Config, manifest: dict[str, Any], loop: LoopState, metrics: MetricsLog | None) -> str:
    import yaml

    rows = metrics.rows if metrics else []
    evals = [r for r in rows if "eval_loss" in r]
    losses = [r for r in rows if "loss" in r]
    facts = {
        "base model": cfg.model.name_or_path,
        "method": f"LoRA r={cfg.model.lora.r}, merged" if cfg.model.lora else "full fine-tune",
        "dataset id": manifest["dataset_id"],
        "steps": loop.step,
        "tokens seen": loop.tokens_seen,
        "workers": loop.world_size,
        "eval loss at step 0": round(evals[0]["eval_loss"], 4) if evals else None,
        "final eval loss": round(evals[-1]["eval_loss"], 4) if evals else None,
        "final train loss": round(losses[-1]["loss"], 4) if losses else None,
    }
    lines = [f"# {cfg.name}", "", "Fine-tuned with unbroken (fault-tolerant fine-tuning on Ray Train).", ""]
    lines += [f"- **{k}**: {v}" for k, v in facts.items()]
    lines += ["", "## Config", "", "```yaml", yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False), "```"]
    return "\n".join(lines) + "\n"


def start_heartbeat(cfg: Config, attempt: int) -> Heartbeat:
    """Rank 0's heartbeat, started now (phase ``loading``)."""
    url = Layout(cfg.storage).heartbeat(cfg.name)
    return Heartbeat(url, cfg.fault_tolerance.heartbeat_every_s, cfg.name, cfg.train.max_steps, attempt).start()


def choose_resume(
    checkpoints_dir: str, explicit: str | None, check=None, refused: list[str] = ()
) -> tuple[str | None, str, dict[str, Any] | None]:
    """Which checkpoint this start resumes from: (url or None, why, its manifest). Reads manifests and one listing
    per checkpoint (``ckpt.check``), no tensor bytes; ``refused``: checkpoints a rank already failed to load.

    The explicit checkpoint (what the watchdog names for its attempt) is a floor, not a pin: the newest valid
    checkpoint at or after its step. On the attempt's first start that is the explicit one itself (the watchdog
    picked the newest); after Ray Train restarts the worker group inside the job it is a newer one -- an in-job
    restart never rewinds past the newest valid checkpoint, and never needs the explicit one to still exist
    (retention deletes it once ``num_to_keep`` newer ones are reported). An explicit checkpoint that is invalid
    with nothing valid after it is an error, not a silent step back. Without one: the newest valid, or none."""
    check = check or ckpt.check
    if explicit in refused:  # a rank read it and found it bad: the newest valid one is older, step back to it
        explicit = None
    floor = ckpt.checkpoint_step(explicit) if explicit else None
    for step, url in ckpt.list_checkpoints(checkpoints_dir):
        if floor is not None and step < floor:
            break
        try:
            if url in refused:
                raise ckpt.CheckpointInvalid("a rank could not load its part")
            manifest = check(url)
        except ckpt.CheckpointInvalid as e:
            log.warning("skipping checkpoint %s (step %d): %s", url, step, e)
            continue
        if explicit is None:
            return url, "the newest valid checkpoint", manifest
        same = url.rstrip("/") == explicit.rstrip("/")
        return url, "the checkpoint named for this attempt" if same else f"newer than {explicit}", manifest
    if explicit is None:
        return None, "no valid checkpoint", None
    try:  # not under this run's checkpoint folder (or listed late): read it where it is
        return explicit, "the checkpoint named for this attempt", check(explicit)
    except ckpt.CheckpointInvalid as e:
        raise ckpt.CheckpointInvalid(
            f"the checkpoint named to resume from, {explicit}, is not valid ({e}) and no valid checkpoint is newer"
        ) from None


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker (and re-runs after a worker-group restart)."""
    from ray_jobs.train.runtime import RayRuntime

    run_worker(loop_config, RayRuntime())


def run_worker(loop_config: dict[str, Any], rt: Runtime) -> Trainer:
    """One rank's whole job, whatever runs it (Ray Train, torchrun, this process): resume or start, train, score on
    the series' eval set, export. ``loop_config``: what ``ray_jobs.job.loop_config`` makes of a job spec."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = from_json(loop_config["config"])
    attempt = loop_config.get("attempt", 0)
    heartbeat = start_heartbeat(cfg, attempt) if rt.rank == 0 else None  # before the model loads
    try:
        trainer = Trainer(cfg, loop_config["manifest"], loop_config["model_path"], rt, heartbeat)
        trainer.attempt = attempt
        trainer.resume_or_start(loop_config.get("resume_from"))
        trainer.fit()
        trainer.score(loop_config.get("score_manifest"))
        trainer.export_final()
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    after = {k: v - trainer.warmup[k] for k, v in trainer.cache.counters().items()}  # what training itself read
    log.info("rank %d shard cache after warm-up: %s; checkpoint stalls (s): %s", trainer.rt.rank, after,
             [round(s, 4) for s in trainer.stalls_s])  # fmt: skip
    return trainer
