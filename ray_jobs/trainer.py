"""The per-worker training loop: resume or start, then train steps, eval, log, checkpoint; rank 0 exports.

``train_loop_per_worker`` is what Ray Train runs on each worker; :class:`Trainer` holds everything and talks
to the cluster only through a :class:`~ray_jobs.runtime.Runtime`, so tests run the same loop in-process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from ray_jobs import checkpoint
from ray_jobs.base_model import load_model, load_tokenizer
from ray_jobs.checkpoint import LoopState, unwrap
from ray_jobs.config import Config, from_json
from ray_jobs.data import Cursor, RankSampler, ShardCache, load_rows, rank_shards
from ray_jobs.runtime import Runtime
from ray_jobs.storage import Layout, download_dir, is_local, read_bytes, upload_dir, write_bytes_atomic

log = logging.getLogger("unbroken.train")
IGNORE_INDEX = -100


def setup_determinism(seed: int, threads: int) -> None:
    """Same seed + same world size = same weights: fixed seeds, deterministic kernels, fixed thread count."""
    import torch

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, threads))


class MetricsLog:
    """``runs/<run>/metrics.jsonl``, written by rank 0: one JSON line per logged step.

    After a resume, lines past the resumed step are dropped, so the file always describes one consistent run;
    a fresh start (``resumed_step`` None) starts an empty file.
    """

    def __init__(self, url: str, resumed_step: int | None):
        self.url = url
        self.rows: list[dict[str, Any]] = []
        if resumed_step is not None:
            with contextlib.suppress(FileNotFoundError):
                lines = read_bytes(url).decode().splitlines()
                self.rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resumed_step]
        self._rewrite()

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if is_local(self.url):
            with open(self.url, "a") as f:
                f.write(json.dumps(row) + "\n")
        else:  # object stores cannot append: rewrite the whole (small) file
            self._rewrite()

    def _rewrite(self) -> None:
        write_bytes_atomic(self.url, "".join(json.dumps(r) + "\n" for r in self.rows).encode())


class Trainer:
    def __init__(self, cfg: Config, manifest: dict[str, Any], model_path: str, rt: Runtime):
        import torch
        from transformers import get_scheduler

        self.cfg, self.rt, self.manifest, self.model_path = cfg, rt, manifest, model_path
        self.layout = Layout(cfg.storage)
        setup_determinism(cfg.train.seed, int(cfg.cluster.cpus_per_worker))
        self.device = rt.device()
        self.model = rt.prepare_model(load_model(model_path, cfg.data.cache_dir).to(self.device))
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = get_scheduler(t.lr_schedule, self.optimizer, t.warmup_steps, t.max_steps)
        self.cache = ShardCache(cfg.storage, manifest["dataset_id"], cfg.data.cache_dir)
        self._load_data()
        self.loop = LoopState(world_size=rt.world_size, dataset_id=manifest["dataset_id"])
        self.cursor = Cursor()
        self.metrics: MetricsLog | None = None
        self._window = (time.monotonic(), 0)

    def _load_data(self) -> None:
        seq_len = self.manifest["seq_len"]
        mine = rank_shards(self.manifest["shards"]["train"], self.rt.rank, self.rt.world_size)
        self.train_ids, self.train_labels = load_rows(self.cache, mine, seq_len)
        eval_ids, eval_labels = load_rows(self.cache, self.manifest["shards"]["eval"], seq_len)
        self.eval_ids = eval_ids[self.rt.rank :: self.rt.world_size]
        self.eval_labels = eval_labels[self.rt.rank :: self.rt.world_size]
        self.sampler = RankSampler(len(self.train_ids), self.cfg.train.seed, self.rt.rank)
        self.pad_id = self.manifest["tokenizer"]["pad_token_id"]

    # -- resume ---------------------------------------------------------------------------------------------
    def resume_or_start(self, explicit_checkpoint: str | None = None) -> None:
        """Load the newest checkpoint (Ray's, or one named explicitly) or start fresh. Safe to run twice."""
        found = self._checkpoint_source(explicit_checkpoint)
        resumed_step = None
        if found is None:
            log.info("rank %d: no checkpoint, starting fresh", self.rt.rank)
        else:
            owner, path = found
            try:
                self.loop, self.cursor = checkpoint.load(
                    path, self.rt.rank, self.rt.world_size, self.model, self.optimizer, self.scheduler
                )
            finally:
                if owner is not None:
                    owner.__exit__(None, None, None)
            resumed_step = self.loop.step
            log.info("rank %d: resumed from %s at step %d (cursor %s)", self.rt.rank, path, self.loop.step, self.cursor)
        if self.rt.rank == 0:
            self.metrics = MetricsLog(self.layout.metrics(self.cfg.name), resumed_step)

    def _checkpoint_source(self, explicit: str | None):
        if explicit:
            local = Path(tempfile.mkdtemp(prefix="unbroken-resume-"))
            return None, download_dir(explicit, local)
        return self.rt.latest_checkpoint_dir()

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> LoopState:
        """Train to ``train.max_steps`` (or return early after step ``stop_at``, as if the job died there)."""
        end = self.cfg.train.max_steps if stop_at is None else min(stop_at, self.cfg.train.max_steps)
        if self.loop.step == 0:
            self._log({"step": 0, "eval_loss": self.evaluate()})
        self._window = (time.monotonic(), self.loop.tokens_seen)
        while self.loop.step < end:
            started = time.monotonic()
            stats = self.train_step()
            self.loop.elapsed_s += time.monotonic() - started
            self._after_step(stats)
        return self.loop

    def _after_step(self, stats: dict[str, float]) -> None:
        step, last = self.loop.step, self.loop.step == self.cfg.train.max_steps
        row: dict[str, Any] = {"step": step}
        if step % self.cfg.train.log_every_steps == 0 or last:
            row |= stats | self._throughput()
        if step % self.cfg.train.eval_every_steps == 0 or last:
            row["eval_loss"] = self.evaluate()
        if len(row) > 1:
            self._log(row)
        if step % self.cfg.checkpoint.every_steps == 0 or last:
            self.save_checkpoint(row)

    def train_step(self) -> dict[str, float]:
        import torch

        t = self.cfg.train
        self.model.train()
        loss_sum, tokens = 0.0, 0
        for micro in range(t.grad_accum_steps):
            idx, self.cursor = self.sampler.take(self.cursor, t.micro_batch_size)
            ids = torch.from_numpy(self.train_ids[idx]).to(self.device)
            labels = torch.from_numpy(self.train_labels[idx]).to(self.device)
            sync = micro == t.grad_accum_steps - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = self.model(input_ids=ids, labels=labels).loss
                (loss / t.grad_accum_steps).backward()
            loss_sum += loss.item() / t.grad_accum_steps
            tokens += int((ids != self.pad_id).sum())
        grad_norm = self._clip()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        g_loss, g_tokens = self.rt.all_reduce_sum([loss_sum, tokens])
        self.loop.step += 1
        self.loop.tokens_seen += int(g_tokens)
        return {"loss": g_loss / self.rt.world_size, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]}

    def _clip(self) -> float:
        import torch

        max_norm = self.cfg.train.max_grad_norm or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def _throughput(self) -> dict[str, float]:
        now = time.monotonic()
        t0, tok0 = self._window
        self._window = (now, self.loop.tokens_seen)
        rate = (self.loop.tokens_seen - tok0) / max(now - t0, 1e-9)
        return {"tokens_seen": self.loop.tokens_seen, "tokens_per_s": round(rate, 1), "elapsed_s": self.loop.elapsed_s}

    def evaluate(self) -> float:
        """Mean loss per target token over the whole eval split (every rank takes a slice; summed across ranks)."""
        import torch

        model = unwrap(self.model)
        model.eval()
        loss_sum, count = 0.0, 0
        mb = self.cfg.train.micro_batch_size
        limit = self.cfg.train.eval_max_batches or None
        with torch.no_grad():
            for b, lo in enumerate(range(0, len(self.eval_ids), mb)):
                if limit is not None and b >= limit:
                    break
                ids = torch.from_numpy(self.eval_ids[lo : lo + mb]).to(self.device)
                labels = torch.from_numpy(self.eval_labels[lo : lo + mb]).to(self.device)
                n = int((labels[:, 1:] != IGNORE_INDEX).sum())
                loss_sum += model(input_ids=ids, labels=labels).loss.item() * n
                count += n
        loss_sum, count = self.rt.all_reduce_sum([loss_sum, float(count)])
        return loss_sum / max(count, 1.0)

    def _log(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.append({**row, "time": time.time()})
            log.info("step %d %s", row["step"], {k: v for k, v in row.items() if k != "step"})

    def save_checkpoint(self, metrics: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="unbroken-ckpt-") as d:
            checkpoint.save(Path(d), self.rt.rank, self.model, self.optimizer, self.scheduler, self.loop, self.cursor)
            self.rt.report({**metrics, "step": self.loop.step}, Path(d))

    # -- the end --------------------------------------------------------------------------------------------
    def export_final(self) -> str | None:
        """Rank 0 writes the final HF folder (weights, tokenizer, model card) to ``runs/<run>/final``."""
        if self.rt.rank != 0:
            return None
        url = self.layout.final_model(self.cfg.name)
        with tempfile.TemporaryDirectory(prefix="unbroken-final-") as d:
            unwrap(self.model).save_pretrained(d)
            load_tokenizer(self.model_path, self.cfg.data.cache_dir).save_pretrained(d)
            (Path(d) / "README.md").write_text(model_card(self.cfg, self.manifest, self.loop, self.metrics))
            upload_dir(d, url)
        log.info("final model written to %s", url)
        return url


def model_card(cfg: Config, manifest: dict[str, Any], loop: LoopState, metrics: MetricsLog | None) -> str:
    import yaml

    rows = metrics.rows if metrics else []
    evals = [r for r in rows if "eval_loss" in r]
    losses = [r for r in rows if "loss" in r]
    facts = {
        "base model": cfg.model.name_or_path,
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


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker."""
    from ray_jobs.runtime import RayRuntime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = from_json(loop_config["config"])
    trainer = Trainer(cfg, loop_config["manifest"], loop_config["model_path"], RayRuntime())
    trainer.resume_or_start(loop_config.get("resume_from"))
    trainer.fit()
    trainer.export_final()
    log.info("rank %d shard cache: %s", trainer.rt.rank, trainer.cache.counters())
