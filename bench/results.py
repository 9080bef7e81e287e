"""The figures the README and the docs quote, as the benchmarks measured them: ``bench/results.json``, one entry per
benchmark (and variant), written by the benchmark itself each time it runs -- its headline numbers, when, and on
what machine. tests/unit/test_figures.py checks the README's figures against it, so a re-run that moves a figure
fails the suite until the README says the new one (or the re-run is not committed)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results.json"


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}"


def load() -> dict[str, dict[str, Any]]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def record(key: str, figures: dict[str, Any], on: str | None = None) -> None:
    """Set ``key``'s entry to ``figures`` with today's date and the machine (``on``: another one, e.g. a GPU's)."""
    results = load()
    results[key] = {"measured": datetime.date.today().isoformat(), "machine": on or machine(), **figures}
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
    tmp.replace(RESULTS)


def from_gpu_kit(lines: list[dict[str, Any]]) -> None:
    """Record the GPU kit's headline figures from its JSON lines (``make gpu-check``'s ``--out``, brought back from
    the GPU machine): the engine leg and the eager throughput leg, on the device the kit names."""
    env = next((x for x in lines if x.get("leg") == "env"), {})
    on = f"{env.get('device', 'a GPU')}, torch {env.get('torch', '?')}"
    engines = {f"{x['engine']}{'+liger' if x['liger'] else ''}": x for x in lines if x.get("leg") == "engine"}
    if engines:
        record("gpu_engine", {k: {"tokens_per_s": x["tokens_per_s"], "vs_native": x.get("vs_native"),
                                  "peak_gb": x["peak_gb"]} for k, x in engines.items()}, on=on)  # fmt: skip
    eager = [x for x in lines if x.get("leg") == "throughput" and not x["activation_checkpointing"]
             and not x["compile"] and x["grad_accum"] == 1]  # fmt: skip
    if eager:
        record("gpu_throughput", {"tokens_per_s": eager[-1]["tokens_per_s"], "mfu_spec": eager[-1]["mfu_spec"],
                                  "model": eager[-1]["model"], "seq": eager[-1]["seq"]}, on=on)  # fmt: skip


if __name__ == "__main__":  # python -m bench.results gpu .unbroken/gpu-check.jsonl
    import sys

    if sys.argv[1:2] != ["gpu"] or len(sys.argv) != 3:
        sys.exit("usage: python -m bench.results gpu GPU_CHECK.jsonl")
    from_gpu_kit([json.loads(x) for x in Path(sys.argv[2]).read_text().splitlines() if x.strip()])
