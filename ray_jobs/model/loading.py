"""Loading a base model and its tokenizer from a hub id, a local folder, or a folder on shared storage."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from ray_jobs.storage import download_dir, is_local


def local_folder(name_or_path: str, cache_root: str | Path) -> str:
    """Return something ``from_pretrained`` can open: a local folder, a hub id, or a storage folder copied locally."""
    if is_local(name_or_path) or not _looks_like_url(name_or_path):
        return name_or_path.removeprefix("file://")
    digest = hashlib.sha256(name_or_path.encode()).hexdigest()[:16]
    return str(download_dir(name_or_path, Path(cache_root) / "models" / digest))


def _looks_like_url(s: str) -> bool:
    return "://" in s


def load_tokenizer(name_or_path: str, cache_root: str | Path | None = None):
    from transformers import AutoTokenizer

    root = cache_root or tempfile.gettempdir()
    return AutoTokenizer.from_pretrained(local_folder(name_or_path, root))


def load_model(name_or_path: str, cache_root: str | Path | None = None, **kwargs):
    from transformers import AutoModelForCausalLM

    root = cache_root or tempfile.gettempdir()
    return AutoModelForCausalLM.from_pretrained(local_folder(name_or_path, root), **kwargs)
