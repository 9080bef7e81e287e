"""Short in-process runs of the real SmolLM2-135M-Instruct (tied embeddings) for the unit tests: seq_len 64,
micro-batch 2, a few steps (about 2.4 s a step full fine-tune, 1.2 s LoRA, on 2 CPU cores)."""

from __future__ import annotations

from pathlib import Path

import torch

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, load_config
from ray_jobs.data.staging import stage
from ray_jobs.model.loading import load_tokenizer
from tests.conftest import ROOT, tiny_overrides
from tests.unit.test_trainer import checkpoints

REAL = {
    "data.seq_len": 64,
    "data.min_shards": 1,
    "cluster.num_workers": 1,  # in-process, one worker: the data laid out for one (one shard is enough)
    "train.micro_batch_size": 2,
    "train.max_steps": 3,
    "train.lr": 1e-4,
    "train.warmup_steps": 0,
    "train.eval_max_batches": 1,
    "train.eval_every_steps": 100,
    "checkpoint.every_steps": 2,
}


def real_config(root: Path, model: str, **extra: object) -> Config:
    overrides = tiny_overrides(root, **{"name": "real", "model.name_or_path": model, **REAL, **extra})
    return load_config(ROOT / "configs" / "demo.yaml", overrides)


def staged(cfg: Config, model: str) -> dict:
    return stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest


def newest_checkpoint(cfg: Config) -> tuple[dict, dict]:
    """(model tensors, optimizer state) of the run's newest checkpoint, as stored."""
    model_sd, optim_sd, _ = ckpt.decode(ckpt.read_verified(checkpoints(cfg)[0][1]))
    return model_sd, optim_sd


def export_tensors(final: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(final.glob("*.safetensors")):
        out |= load_file(f)
    return out


def load_and_generate(final: Path):
    """The exported folder loaded as any HF model (its saved dtype) and the text it generates for a prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    lm = AutoModelForCausalLM.from_pretrained(final)
    out = lm.generate(**tok("12+3=", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    return lm, tok.decode(out[0], skip_special_tokens=True)


def tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight
