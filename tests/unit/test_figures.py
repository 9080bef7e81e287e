"""The README's figures are the benchmarks' own (issue 36): every figure of its "Figures" table that a benchmark
records in bench/results.json (bench/results.py: written by the benchmark each time it runs) must read as recorded.
A re-run that moves a figure fails here until the README says the new one."""

from __future__ import annotations

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
