"""The end of a run: the final HF folder (weights, tokenizer, model card) at ``runs/<run>/final``. Writing a big
model's weights and uploading the folder take a while: rank 0 logs their progress every few seconds once one has
taken a few (bytes written of the weights' size, then bytes uploaded; MB/s, ETA)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import tempfile
from pathlib import Path

from ray_jobs import checkpoint as ckpt
from ray_jobs.checkpoint import LoopState, unwrap
from ray_jobs.config import Config
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.progress import Reporter, every_s, polled
from ray_jobs.secrets import mask_tree
from ray_jobs.storage import Layout, fs_and_path, is_local, upload_dir
from ray_jobs.train.metrics import MetricsLog
from ray_jobs.train.model import export_dtype, export_model, finish_in_place, write_sharded_export
from ray_jobs.train.runtime import Runtime

log = logging.getLogger("unbroken.train")


def write_final(
    cfg: Config,
    rt: Runtime,
    model,
    model_path: str,
    manifest: DatasetManifest,
    loop: LoopState,
    metrics: MetricsLog | None,
) -> str | None:
    """The final HF folder (merged weights -- or the adapters, ``train.export: adapter`` -- in
    ``train.export_dtype``, tokenizer, model card) at
    ``runs/<run>/final``, made from the trained model itself: in place under DDP (rank 0), gathered a tensor at
    a time under FSDP (every rank joins, rank 0 writes); only FSDP + LoRA still builds a second model to merge.
    Its URL on rank 0, None on the others."""
    url = Layout(cfg.storage).final_model(cfg.name)
    with tempfile.TemporaryDirectory(prefix="unbroken-final-") as d:
        weights = _progress("final model: weights written", _weight_bytes(cfg, model_path, model), lambda: _bytes(d))
        with weights if rt.rank == 0 else contextlib.nullcontext():
            _write_weights(cfg, rt, model, model_path, d)
        if rt.rank != 0:
            return None
        load_tokenizer(model_path, cfg.data.cache_dir).save_pretrained(d)
        (Path(d) / "README.md").write_text(model_card(cfg, manifest, loop, metrics))
        with _progress(f"final model: uploaded to {url}", _bytes(d), lambda: _published(url)):
            upload_dir(d, url)
    log.info("final model written to %s", url)
    return url


def _write_weights(cfg: Config, rt: Runtime, model, model_path: str, folder: str) -> None:
    fsdp, lora = cfg.train.parallelism == "fsdp", cfg.model.lora is not None
    if fsdp and not lora:
        write_sharded_export(cfg, model_path, model, rt.rank, folder)
    elif fsdp or cfg.model.quantization != "none":
        state = ckpt.model_state(model, fsdp, True)  # the adapters only: small (under FSDP, gathered)
        if rt.rank == 0:
            _save(cfg, export_model(cfg, model_path, state), folder)
    elif rt.rank == 0:
        _save(cfg, finish_in_place(cfg, model_path, unwrap(model)), folder)


def _progress(what: str, total: float, read_done):
    """A progress line every few seconds (once the work has taken a few) while the body runs, polled from
    ``read_done()``: the work is a library's (``save_pretrained``, an upload), which reports nothing itself."""
    return polled(Reporter(what, total, quiet_s=every_s(), log=log, tty=False), read_done)


def _weight_bytes(cfg: Config, model_path: str, model) -> int:
    """The final weights' size: every parameter (tied ones once; LoRA's adapters merged away) in the export dtype."""
    import torch

    itemsize = getattr(torch, export_dtype(cfg, model_path)).itemsize
    params = unwrap(model).named_parameters()
    if cfg.train.export == "adapter":  # the trained parameters alone (adapters, modules_to_save)
        return itemsize * sum(p.numel() for _, p in params if p.requires_grad)
    return itemsize * sum(p.numel() for n, p in params if "lora_" not in n)


def _bytes(folder: str | Path) -> int:
    """Bytes in the files under ``folder`` (one written meanwhile counts as far as it got)."""
    total = 0
    for p in Path(folder).rglob("*"):
        with contextlib.suppress(OSError):
            total += p.stat().st_size if p.is_file() else 0
    return total


def _published(url: str) -> int:
    """Bytes of the final folder uploaded so far: locally it is copied beside its place first (``upload_dir``)."""
    if is_local(url):
        return sum(_bytes(p) for p in glob.glob(f"{fs_and_path(url)[1]}.partial-*"))
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)
    return fs.du(path) if fs.exists(path) else 0


def _save(cfg: Config, model, folder: str) -> None:
    model.save_pretrained(folder, max_shard_size=f"{cfg.train.export_shard_mb}MB")


def model_card(cfg: Config, manifest: DatasetManifest, loop: LoopState, metrics: MetricsLog | None) -> str:
    import yaml

    rows = metrics.rows if metrics else []
    evals = [r for r in rows if "eval_loss" in r]
    losses = [r for r in rows if "loss" in r]
    facts = {
        "base model": cfg.model.name_or_path,
        "method": f"LoRA r={cfg.model.lora.r}, {cfg.train.export}" if cfg.model.lora else "full fine-tune",
        "dataset id": manifest.dataset_id,
        "steps": loop.step,
        "tokens seen": loop.tokens_seen,
        "workers": loop.world_size,
        "eval loss at step 0": round(evals[0]["eval_loss"], 4) if evals else None,
        "final eval loss": round(evals[-1]["eval_loss"], 4) if evals else None,
        "final train loss": round(losses[-1]["loss"], 4) if losses else None,
    }
    lines = [f"# {cfg.name}", "", "Fine-tuned with unbroken (fault-tolerant fine-tuning on Ray Train).", ""]
    lines += [f"- **{k}**: {v}" for k, v in facts.items()]
    lines += [
        "",
        "## Config",
        "",
        "```yaml",
        yaml.safe_dump(mask_tree(json.loads(cfg.model_dump_json())), sort_keys=False),
        "```",
    ]
    return "\n".join(lines) + "\n"
