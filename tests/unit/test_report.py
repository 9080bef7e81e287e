"""Artifacts of a long run stay the size of a short run's: tables and charts are thinned evenly, ends kept."""

from __future__ import annotations

from pathlib import Path

from ray_jobs.config import load_config
from tasks.report import CHART_POINTS, TABLE_ROWS, loss_chart_markdown, metrics_table, thin
from tests.conftest import ROOT


def test_a_100k_step_runs_tables_and_chart_are_thinned_keeping_first_and_last(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "name=long"])
    rows = [{"step": s, "loss": 1 / s, "lr": 1e-3} | ({"eval_loss": 2 / s} if s % 10 == 0 else {})
            for s in range(1, 100_001)]  # fmt: skip
    table = metrics_table(cfg, rows)
    assert len(table) <= TABLE_ROWS + 1 and table[0]["step"] == 1 and table[-1]["step"] == 100_000
    chart = loss_chart_markdown(cfg, rows)
    assert chart.count("|") < 4 * (TABLE_ROWS + 3) and "| 100000 |" in chart
    line = next(x for x in chart.splitlines() if x.strip().startswith("line ["))
    assert line.count(",") <= CHART_POINTS


def test_thin_keeps_short_lists_whole() -> None:
    assert thin(list(range(5)), 10) == [0, 1, 2, 3, 4]
    assert thin(list(range(11)), 5)[-1] == 10
