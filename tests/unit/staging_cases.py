"""Staging inputs whose outputs are pinned byte for byte in ``staging_golden.json``.

The golden file was written by the in-memory staging path (the code before streaming staging, commit bfa68c5) with

    .venv/bin/python -m tests.unit.staging_cases > tests/unit/staging_golden.json

so the test comparing against it says: streaming staging writes exactly the shards, manifest and rejects the old
path wrote for the same input. Staging version 3 (long documents, ``data.too_long``, other tools' shapes) re-pinned
the manifests and dataset ids (the version and the new counts are in them); every shard and rejects file kept its
bytes. The typed manifest (ray_jobs/contracts/dataset.py) re-pinned the manifests once more: each now begins with its
``schema_version``; dataset ids, shards and rejects kept their bytes. Paths in the outputs are made relative to the
case folder, so any checkout compares.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, SAMPLE_DATA

CHAT_DATA = ROOT / "configs" / "data" / "chat_json.jsonl"


def _mixed_lines(n: int) -> list[bytes]:
    """Pairs with every kind of bad record sprinkled in: bad JSON, bad UTF-8, missing/empty fields, too long."""
    rng = random.Random(7)
    out: list[bytes] = []
    for i in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        kind = i % 53
        if kind == 5:
            out.append(b'{"input": "broken')
        elif kind == 11:
            out.append(b'{"input": "\xff\xfe", "target": "x"}')
        elif kind == 17:
            out.append(json.dumps({"input": f"{a}+{b}="}).encode())
        elif kind == 23:
            out.append(json.dumps({"input": "  ", "target": "1"}).encode())
        elif kind == 29:
            out.append(json.dumps({"input": "9" * 300, "target": "1"}).encode())
        elif kind == 31:
            out.append(b"")
        else:
            out.append(json.dumps({"input": f"{a}+{b}=", "target": str(a + b)}).encode())
    return out


def _write_parquet(path: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"record {i}: {'lorem ipsum ' * (i % 7)}end" for i in range(n)]
    texts[13] = ""  # an empty text is a reject naming its row
    pq.write_table(pa.table({"text": texts}), path, row_group_size=97)


def build_inputs(folder: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (DataConfig fields, tokenizer: "char" or "smollm2"); writes the generated inputs under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mixed.jsonl").write_bytes(b"\n".join(_mixed_lines(2500)) + b"\n")
    (folder / "mixed-eval.jsonl").write_bytes(b"\n".join(_mixed_lines(300)))  # no final newline
    _write_parquet(folder / "texts.parquet", 1200)
    return {
        "pairs-sample": ({"train": str(SAMPLE_DATA), "seq_len": 64, "shard_mb": 0.05, "min_shards": 2}, "char"),
        "pairs-mixed-separate-eval": (
            {
                "train": str(folder / "mixed.jsonl"),
                "eval": str(folder / "mixed-eval.jsonl"),
                "seq_len": 48,
                "shard_mb": 0.02,
                "min_shards": 3,
                "max_reject_fraction": 0.5,
            },
            "char",
        ),  # fmt: skip
        "text-parquet": (
            {
                "train": str(folder / "texts.parquet"),
                "format": "text",
                "seq_len": 128,
                "shard_mb": 0.03,
                "min_shards": 2,
                "max_reject_fraction": 0.01,
                "eval_fraction": 0.1,
            },
            "char",
        ),  # fmt: skip
        "chat-sample": ({"train": str(CHAT_DATA), "format": "chat", "seq_len": 256, "min_shards": 2}, "smollm2"),
    }


def tokenizer(kind: str):
    if kind == "char":
        from ray_jobs.model.builtin import train_char_tokenizer

        return train_char_tokenizer()
    from transformers import AutoTokenizer

    from tests.models import smollm2

    return AutoTokenizer.from_pretrained(smollm2())


def outputs(dataset_dir: Path, roots: list[str]) -> dict[str, str]:
    """sha256 of every file staging wrote, with the input folders' paths replaced by placeholders."""
    out = {}
    for p in sorted(dataset_dir.iterdir()):
        data = p.read_bytes()
        for i, root in enumerate(roots):
            data = data.replace(root.encode(), f"<root{i}>".encode())
        out[p.name] = hashlib.sha256(data).hexdigest()
    return out


def run_cases(
    folder: Path, only: set[str] | None = None, on: str = "local", **overrides: Any
) -> dict[str, dict[str, Any]]:
    """Stage every case (``overrides``: DataConfig fields that must not change the output, e.g. ``workers``; ``on``:
    where staging runs, which must not change it either)."""
    from ray_jobs.config import DataConfig
    from ray_jobs.data.staging import stage

    results = {}
    toks: dict[str, Any] = {}
    for name, (fields, kind) in build_inputs(folder / "inputs").items():
        if only is not None and name not in only:
            continue
        tok = toks.setdefault(kind, tokenizer(kind))
        storage = folder / "storage" / name
        r = stage(DataConfig(**fields, **overrides), tok, "tok", str(storage), on=on)
        roots = [str(folder / "inputs"), str(ROOT / "configs" / "data")]
        results[name] = {"dataset_id": r.dataset_id, "files": outputs(storage / "datasets" / r.dataset_id, roots)}
    return results


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run_cases(Path(d)), indent=1, sort_keys=True))
