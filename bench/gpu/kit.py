"""The legs of the GPU kit (see ``bench/gpu/__init__.py``). Imports only ray_jobs (never Ray, never Prefect)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import shutil
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
PREFIX = "UNBROKEN_GPU "

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B's shape: 1.24 B parameters, tied embeddings, GQA 32/8, a 128k vocabulary.
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
           "max_position_embeddings": 8192},
    # ~176 M: the resume and precision legs, which write and read several checkpoints.
    "150m": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": True,
             "max_position_embeddings": 4096},
    "toy": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 256},
}  # fmt: skip


@dataclass(frozen=True)
class Size:
    model: str  # the throughput, LoRA and checkpoint legs' model
    small: str  # the resume and precision legs'
    seq: int
    micro_batch: int
    steps: int  # throughput steps per variant; tokens/s is taken over the steps after `warm`
    warm: int
    resume_steps: int
    matmul_n: int


SIZES = {
    "1b": Size("1b", "150m", seq=2048, micro_batch=4, steps=12, warm=4, resume_steps=8, matmul_n=8192),
    "toy": Size("toy", "toy", seq=64, micro_batch=2, steps=4, warm=1, resume_steps=4, matmul_n=256),
}


def emit(line: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(line, sort_keys=True)
    print(PREFIX + text, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n")


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- what a leg trains on -------------------------------------------------------------------------------------
def build_model(shape: str, out: Path, seed: int = 0) -> Path:
    """A random-init Llama of ``shape`` with the built-in character tokenizer, as a save_pretrained folder (bf16
    on a GPU: half the bytes to write and read; training loads it into fp32 master weights either way)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ray_jobs.model.builtin import train_char_tokenizer

    tok = train_char_tokenizer()
    config = LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    dev = device()
    with torch.device(dev):
        model = LlamaForCausalLM(config)
    if dev == "cuda":
        model = model.to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    del model
    return out


def write_corpus(path: Path, seq: int, docs: int, seed: int = 0) -> Path:
    """``docs`` records of generated text, each exactly one packed row long (BOS + text + EOS = ``seq`` tokens of the
    character tokenizer): every row is one document, so attention is the plain causal kind (no packed-sequence
    mask) and every token counts."""
    if path.exists():
        return path
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation
    with path.open("w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": "".join(rng.choices(alphabet, k=seq - 2))}) + "\n")
    return path


def config(work: Path, name: str, model: Path, size: Size, **extra: Any):
    from ray_jobs.config import load_config

    cuda = device() == "cuda"
    docs = int((size.steps + 4) * size.micro_batch * 4 / 0.9) + 8  # enough rows for grad_accum 4 variants
    corpus = write_corpus(work / f"corpus-{size.seq}.jsonl", size.seq, docs)
    base = {"name": name, "storage": work / "storage", "data.train": corpus, "data.format": "text",
            "data.seq_len": size.seq, "data.min_shards": 1, "data.eval_fraction": 0.05,
            "data.cache_dir": work / "cache", "data.work_dir": work / "staging", "model.name_or_path": model,
            "train.micro_batch_size": size.micro_batch, "train.grad_accum_steps": 1, "train.max_steps": size.steps,
            "train.warmup_steps": 0, "train.log_every_steps": 1, "train.eval_every_steps": 10**6,
            "train.eval_max_batches": 1, "train.sample_generations": 0, "checkpoint.every_steps": 0,
            "cluster.num_workers": 1, "cluster.use_gpu": cuda,
            "cluster.cpus_per_worker": max(1, (os.cpu_count() or 2) // 2) if cuda else 1, **extra}  # fmt: skip
    return load_config(DEMO, [f"{k}={v}" for k, v in base.items()])


def trainer(cfg):
    """The project's Trainer on this device -- the ``hf`` engine's for ``train.engine: hf`` -- resumed or fresh,
    exactly as ``unbroken train`` makes it."""
    from ray_jobs.local import prepare
    from ray_jobs.train.runtime import LocalRuntime
    from ray_jobs.train.trainer import Trainer

    loop = prepare(cfg)
    if cfg.train.engine == "hf":
        from ray_jobs.train.hf import HfTrainer as Trainer  # noqa: N814 (the same constructor)
    t = Trainer(cfg, loop.manifest, loop.inputs.model_path, LocalRuntime(device()))
    t.resume_or_start()
    return t


def release(t) -> None:
    import torch

    del t
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None


def tokens_per_s(rows: list[dict[str, Any]], warm: int) -> tuple[float, int]:
    """Steady tokens/s over the logged steps after ``warm`` (compilation, autotuning and allocation happen there)."""
    timed = [r for r in rows if "tokens_seen" in r and r["step"] >= warm]
    a, b = timed[0], timed[-1]
    return (b["tokens_seen"] - a["tokens_seen"]) / (b["time"] - a["time"]), b["step"] - a["step"]


def flops_per_token(shape: str, seq: int) -> float:
    """Model FLOPs per trained token (torchtitan's count): 6 x matmul parameters (every linear layer and the output
    head; the embedding lookup is no matmul) + 12 x layers x heads x head dim x sequence length (attention)."""
    s = SHAPES[shape]
    h, layers, heads, kv = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"]
    d = h // heads
    per_layer = 2 * h * h + 2 * h * kv * d + 3 * h * s["intermediate_size"]
    return 6 * (layers * per_layer + h * s["vocab_size"]) + 12 * layers * heads * d * seq


# -- legs -----------------------------------------------------------------------------------------------------
def leg_matmul(size: Size) -> dict[str, Any]:
    """bf16 matrix product TFLOP/s on this device (mean of 10 after 3 warm-ups)."""
    import torch

    n, dev = size.matmul_n, device()
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    tflops = 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12
    return {"leg": "matmul", "n": n, "dtype": "bfloat16", "tflops": float(f"{tflops:.4g}")}


def leg_throughput(
    work: Path, size: Size, model: Path, ac: bool, compiled: bool, matmul_tflops: float, accum: int = 1
) -> dict:
    cfg = config(work, f"tp-ac{int(ac)}-c{int(compiled)}-a{accum}", model, size, **{
                 "train.gradient_checkpointing": ac, "train.compile": compiled, "train.grad_accum_steps": accum})  # fmt: skip
    t = trainer(cfg)
    t.fit(stop_at=size.steps)  # no final checkpoint: this leg times steps
    tps, steps = tokens_per_s(t.metrics.rows, size.warm)
    flops = tps * flops_per_token(size.model, size.seq)
    peak = spec_peak()
    line = {"leg": "throughput", "model": size.model, "params": n_params(t.model), "seq": size.seq,
            "micro_batch": size.micro_batch, "grad_accum": accum, "activation_checkpointing": ac, "compile": compiled,
            "precision": "bf16-autocast" if t.device.type == "cuda" else "fp32", "fused_adamw": fused(t),
            "steps_timed": steps, "tokens_per_s": round(tps, 1), "model_tflops": float(f"{flops / 1e12:.4g}"),
            "mfu_spec": round(flops / peak, 4) if peak else None,
            "mfu_matmul": round(flops / (matmul_tflops * 1e12), 4), "peak_gb": peak_gb()}  # fmt: skip
    release(t)
    _reset_compile()
    return line


def engine_variants() -> list[tuple[str, bool]]:
    """(engine, Liger) pairs the engine leg times: native and hf everywhere; hf with Liger's kernels on a CUDA device
    where ``liger-kernel`` is installed (its Triton kernels need one)."""
    import importlib.util

    liger = device() == "cuda" and importlib.util.find_spec("liger_kernel") is not None
    return [("native", False), ("hf", False), *([("hf", True)] if liger else [])]


def leg_engine(work: Path, size: Size, model: Path, engine: str, liger: bool) -> dict:
    """Tokens/s of one engine on the same rows (``train.engine``; HF's ``use_liger_kernel`` for the Liger variant)."""
    extra: dict[str, Any] = {"train.engine": engine}
    if liger:
        extra["train.hf_args"] = "{use_liger_kernel: true}"
    cfg = config(work, f"engine-{engine}{'-liger' if liger else ''}", model, size, **extra)
    t = trainer(cfg)
    t.fit(stop_at=size.steps)
    tps, steps = tokens_per_s(t.metrics.rows, size.warm)
    line = {"leg": "engine", "engine": engine, "liger": liger, "model": size.model, "seq": size.seq,
            "micro_batch": size.micro_batch, "steps_timed": steps, "tokens_per_s": round(tps, 1),
            "peak_gb": peak_gb()}  # fmt: skip
    release(t)
    return line


def leg_lora(work: Path, size: Size, model: Path) -> dict:
    cfg = config(work, "lora", model, size, **{"model.lora.r": 16, "model.lora.alpha": 32,
                 "model.lora.target_modules": "all-linear"})  # fmt: skip
    t = trainer(cfg)
    t.fit(stop_at=size.steps)
    tps, steps = tokens_per_s(t.metrics.rows, size.warm)
    trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
    line = {"leg": "lora", "model": size.model, "target_modules": "all-linear", "r": 16, "seq": size.seq,
            "micro_batch": size.micro_batch, "trainable_params": trainable, "steps_timed": steps,
            "tokens_per_s": round(tps, 1), "peak_gb": peak_gb()}  # fmt: skip
    release(t)
    return line


def leg_checkpoint(work: Path, size: Size, model: Path) -> dict:
    """Two checkpoints of the same training, taken by the Trainer's own ``checkpoint`` one step apart, written
    synchronously and then asynchronously. Per save: the training thread's blocked time (``stall``, what the loop
    records) and the time until the device-to-host copies are done too (``device_s``: on a GPU they are queued on the
    training stream, so the next step waits for them). The first save allocates the reusable host buffers; the
    second is the steady cost. Each write is let finish before the next step, off the clock."""
    import torch

    out: dict[str, Any] = {"leg": "checkpoint", "model": size.model}
    for mode in ("sync", "async"):
        cfg = config(work, f"ckpt-{mode}", model, size, **{"checkpoint.async_write": mode == "async"})
        t = trainer(cfg)
        stalls, device_s = [], []
        for _ in range(2):
            t.agreed(*t.train_step())
            t.loop.step += 1
            sync()
            t0 = time.perf_counter()
            stalls.append(t.checkpoint(sync=mode == "sync"))
            sync()
            device_s.append(time.perf_counter() - t0)
            if t.checkpointer.pending is not None:
                t.checkpointer.commit()  # the write itself, off the clock
        t.checkpointer.writer.close()
        ckdir = Path(t.layout.checkpoints_dir(cfg.name))
        newest = max(ckdir.iterdir())
        out["checkpoint_gb"] = round(sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 1e9, 2)
        out[f"{mode}_stalls_s"] = [round(x, 4) for x in stalls]
        out[f"{mode}_device_s"] = [round(x, 4) for x in device_s]
        release(t)
        shutil.rmtree(ckdir, ignore_errors=True)  # a 1 B model's checkpoint is ~15 GB with its AdamW moments
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out["sync_stall_s"], out["async_stall_s"] = out["sync_stalls_s"][-1], out["async_stalls_s"][-1]
    out["async_device_s"] = out["async_device_s"][-1]
    out["stall_ratio"] = round(out["async_device_s"] / out["sync_stall_s"], 4) if out["sync_stall_s"] else None
    return out


def leg_resume(work: Path, size: Size, model: Path, deterministic: bool) -> dict:
    """N steps straight vs N/2 (checkpointed), a new process resuming, N/2 more; each part its own process (cuBLAS
    reads its workspace setting once per process)."""
    n, half = size.resume_steps, size.resume_steps // 2
    tag = "det" if deterministic else "fast"
    straight = _part(work, size, model, f"resume-{tag}-straight", n, None, deterministic)
    _part(work, size, model, f"resume-{tag}-split", n, half, deterministic)
    resumed = _part(work, size, model, f"resume-{tag}-split", n, None, deterministic)
    assert resumed["resumed_from_step"] == half, resumed
    line = {"leg": "resume", "model": size.small, "deterministic": deterministic, "steps": n, "stopped_at": half,
            "straight_sha256": straight["sha256"], "resumed_sha256": resumed["sha256"],
            "bit_identical": straight["sha256"] == resumed["sha256"]}  # fmt: skip
    if not deterministic:
        line["max_abs_diff"] = _max_abs_diff(Path(straight["checkpoint"]), Path(resumed["checkpoint"]))
    return line


def _part(work: Path, size: Size, model: Path, name: str, steps: int, stop_at: int | None, det: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu", "--part", json.dumps({"work": str(work), "size": size_name(size),
           "model": str(model), "name": name, "steps": steps, "stop_at": stop_at, "deterministic": det})]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"resume part {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1].removeprefix(PREFIX))


def run_part(spec: dict[str, Any]) -> dict[str, Any]:
    """One process of the resume leg: train ``steps`` (checkpoint every steps/2), or stop after ``stop_at``."""
    size = SIZES[spec["size"]]
    cfg = config(Path(spec["work"]), spec["name"], Path(spec["model"]), size, **{"train.max_steps": spec["steps"],
                 "checkpoint.every_steps": spec["steps"] // 2, "train.deterministic": spec["deterministic"]})  # fmt: skip
    t = trainer(cfg)
    resumed_from = t.loop.step if t.resumed_from else None
    t.fit(stop_at=spec["stop_at"])
    from ray_jobs import checkpoint as ckpt

    url = ckpt.list_checkpoints(t.layout.checkpoints_dir(cfg.name))[0][1]
    return {"checkpoint": url, "step": t.loop.step, "resumed_from_step": resumed_from, "sha256": _weights_sha(url)}


def _weights_sha(checkpoint: str) -> str:
    import torch
    from safetensors.torch import load_file

    state = load_file(str(Path(checkpoint) / "model.safetensors"))
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(state[k].contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _max_abs_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def leg_precision(work: Path, size: Size, model: Path) -> dict:
    """fp32 master weights and AdamW moments, in memory and in the checkpoint; the export in bf16."""
    import torch
    from safetensors.torch import load_file

    from ray_jobs import checkpoint as ckpt

    small = Size(size.small, size.small, size.seq, size.micro_batch, 2, 0, 2, size.matmul_n)
    cfg = config(work, "precision", model, small, **{"train.export_dtype": "bfloat16"})
    t = trainer(cfg)
    t.fit()  # 2 steps and the final (synchronous) checkpoint
    params = {p.dtype for p in t.model.parameters()}
    moments = {v.dtype for s in t.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    url = Path(ckpt.list_checkpoints(t.layout.checkpoints_dir(cfg.name))[0][1])
    saved = {v.dtype for v in load_file(str(url / ckpt.MODEL_FILE)).values()}
    optim = torch.load(url / ckpt.OPTIM_FILE, weights_only=True)
    saved_moments = {v.dtype for v in _tensors(optim) if v.dim() > 0}
    final = Path(t.export_final())
    exported = {v.dtype for f in final.glob("*.safetensors") for v in load_file(str(f)).values()}
    line = {"leg": "precision", "model": size.small, "params": _names(params), "adam_moments": _names(moments),
            "checkpoint_params": _names(saved), "checkpoint_moments": _names(saved_moments),
            "export": _names(exported), "autocast": "bf16" if t.device.type == "cuda" else "off (cpu: fp32)"}  # fmt: skip
    line["ok"] = (line["params"] == line["adam_moments"] == line["checkpoint_params"] == line["checkpoint_moments"]
                  == ["float32"] and line["export"] == ["bfloat16"])  # fmt: skip
    release(t)
    return line


def _tensors(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def leg_env() -> dict:
    import torch
    import transformers

    top = {m.split(".")[0] for m in sys.modules}
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"leg": "env", "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "ray_imported": "ray" in top, "prefect_imported": "prefect" in top}  # fmt: skip


# -- small helpers --------------------------------------------------------------------------------------------
def spec_peak() -> float | None:
    """The card's dense bf16 peak (the table the training job's MFU gauge reads too)."""
    from ray_jobs.train.flops import gpu_peak_flops

    return gpu_peak_flops()


def n_params(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def fused(t) -> bool:
    return bool(t.optimizer.defaults.get("fused"))


def size_name(size: Size) -> str:
    return next(k for k, v in SIZES.items() if v == size)


def _names(dtypes) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)


def _reset_compile() -> None:
    import torch

    torch._dynamo.reset()
