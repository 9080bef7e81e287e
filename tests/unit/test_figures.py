"""The README's figures are the benchmarks' own (issue 36): every figure of its "Figures" table, and of the docs pages
that quote a run in full (engines, GPUs), that a benchmark records in bench/results.json (bench/results.py: written
by the benchmark each time it runs) must read as recorded. A re-run that moves a figure fails here until the page
says the new one."""

from __future__ import annotations

import math
import re

from bench.results import load
from tests.conftest import ROOT


def quoted(results: dict) -> list[tuple[str, str]]:
    """(benchmark, the text the README's Figures table must hold) for each recorded benchmark it quotes."""
    out = []
    if e := results.get("engine_throughput"):
        out.append(("engine_throughput", f"{e['hf_vs_native']:.2f} on CPU"))
    if g := results.get("gpu_engine"):
        out.append(
            ("gpu_engine", f"{g['hf']['vs_native']:.2f} on an H200, {g['hf+liger']['vs_native']:.2f} with Liger")
        )
    if t := results.get("gpu_throughput"):
        out.append(("gpu_throughput", f"{t['tokens_per_s']:,.0f} tok/s"))
        out.append(("gpu_throughput", f"{100 * t['mfu_spec']:.1f} %"))
    if r := results.get("run_overhead"):
        out.append(
            ("run_overhead", f"{r['warm_from_flow_s']} s a run (torchrun of the same loop: {r['torchrun_s']} s)")
        )
    for key, g in results.items():
        if key.startswith("goodput_") and "on" in g and "off" in g:
            out.append((key, f"{g['off']:.3f} / {g['on']:.3f}"))
    return out


def test_the_readme_quotes_what_the_benchmarks_recorded() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Figures") :].split("\n## ", 1)[0]
    checks = quoted(load())
    assert checks, "bench/results.json records the figures the README quotes"
    stale = [(bench, text) for bench, text in checks if text not in table]
    assert not stale, f"README figures that differ from bench/results.json: {stale}"


def _n(x: float) -> str:
    """A count as the pages print it (thousands separated), to be found in a page: bench/results.json keeps one
    decimal of the figure the benchmark printed rounded, so a recorded 36820.5 stands for 36,820 or 36,821."""
    return "|".join(sorted({f"{math.floor(x):,}", f"{math.ceil(x):,}"}))


def quoted_in_docs(results: dict) -> list[tuple[str, str, str]]:
    """(page, benchmark, the text the page must hold) for each recorded figure a docs page quotes in full."""
    out = []
    if e := results.get("engine_throughput"):
        out.append(("engines.md", "engine_throughput", f"native {_n(e['native_tokens_per_s'])}, "
                    f"hf {_n(e['hf_tokens_per_s'])} -> **{e['hf_vs_native']:.2f}**"))  # fmt: skip
    if g := results.get("gpu_engine"):
        for engine in ("native", "hf", "hf+liger"):  # the latest call's figure (last in its cell) is the one recorded
            out.append(("gpu.md", "gpu_engine", f" / {_n(g[engine]['tokens_per_s'])} |"))
        out.append(("gpu.md", "gpu_engine", f"**{g['hf+liger']['peak_gb']:.1f}**"))
    if t := results.get("gpu_throughput"):
        out.append(("gpu.md", "gpu_throughput", f"eager **{_n(t['tokens_per_s'])}** tok/s"))
        out.append(("gpu.md", "gpu_throughput", f"MFU **{100 * t['mfu_spec']:.1f} %**"))
    return out


def test_the_docs_pages_quote_what_the_benchmarks_recorded() -> None:
    checks = quoted_in_docs(load())
    stale = [
        (page, bench, text) for page, bench, text in checks if not _holds((ROOT / "docs" / page).read_text(), text)
    ]
    assert not stale, f"docs figures that differ from bench/results.json: {stale}"


def _holds(page: str, text: str) -> bool:
    """Whether ``page`` holds ``text``, a count in it given as ``a|b`` (either reading)."""
    pattern = re.sub(r"(\d{1,3}(?:,\d{3})*)\\\|(\d{1,3}(?:,\d{3})*)", r"(?:\1|\2)", re.escape(text))
    return re.search(pattern, page) is not None
