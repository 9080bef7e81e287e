"""A finished search, as the Prefect UI shows it: a table of its trials (values, state, steps, eval loss, score on
the series' eval set, starts) and a chart of each trial's eval loss over steps; returns what the CLI prints."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from control import series
from control.logs import run_logger
from control.series.views import short_value
from control.summaries import SearchSummary, TableRow
from ray_jobs.config import Config
from ray_jobs.contracts.trials import TrialEntry
from tasks.report import mermaid_chart

# one colour per trial's line
CHART_THEME = (
    '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": '
    '"#ff6b35, #2a9d8f, #264653, #e9c46a, #8338ec, #e63946, #06d6a0, #118ab2"}}}}%%'
)


@task(name="summarize-search", cache_policy=NO_CACHE)
def summarize_search(cfg: Config, dataset_id: str) -> SearchSummary:
    """Trial table and eval-loss chart as artifacts; the winner and its final model."""
    found = series.sync_trials(cfg.storage, cfg.name)
    best = series.winner(found)
    rows = trial_rows(cfg, found, best)
    final = series.final_model(cfg.storage, cfg.name)
    create_table_artifact(rows, key=f"{cfg.name}-trials", description=f"trials of search {cfg.name}")
    create_markdown_artifact(
        trials_chart_markdown(cfg, found), key=f"{cfg.name}-trials-chart", description="eval loss of each trial by step"
    )
    if final:
        create_link_artifact(final, link_text=f"final model of the winner, {best}", key=f"{cfg.name}-final-model")
    run_logger().info(
        "search %s: winner %s (eval loss %s); trials: %s",
        cfg.name,
        best or "none",
        found[best].eval_loss if best else "-",
        ", ".join(f"{r['trial']} {r['state']}" for r in rows),
    )
    return {"run": cfg.name, "dataset_id": dataset_id, "trials": rows, "winner": best, "final_model": final}


def trial_rows(cfg: Config, found: dict[str, TrialEntry], best: str | None) -> list[TableRow]:
    """One row per trial, in order (plain dicts: what the CLI prints and a table artifact takes)."""
    rows = []
    for name, t in sorted(found.items(), key=lambda kv: kv[1].index):
        score = series.score_of(cfg.storage, name)
        rows.append(
            {
                "trial": name,
                **{k: short_value(v) for k, v in t.params.items()},
                "state": t.state,
                "steps": t.step,
                "eval_loss": t.eval_loss,
                "score": score,
                "starts": t.starts,
                "winner": name == best,
            }
        )
    return rows


def trials_chart_markdown(cfg: Config, found: dict[str, TrialEntry]) -> str:
    """Each trial's eval loss at every reported step, one line per trial, as a mermaid ``xychart-beta`` chart
    (a trial stopped early has a shorter line), and which line is which."""
    ordered = sorted(found.items(), key=lambda kv: kv[1].index)
    steps = sorted({h[0] for _, t in ordered for h in t.history})
    curves = [ys for _, t in ordered if (ys := [h[1] for h in t.history if h[1] is not None])]
    top = max((y for ys in curves for y in ys), default=0.0)
    lines = [
        f"# Search {cfg.name}: eval loss by step",
        "",
        *mermaid_chart(
            f"{cfg.name}: eval loss of each trial", "eval loss", [str(x) for x in steps], curves, top, CHART_THEME
        ),
        "",
        "| line | trial | values | state | steps | eval loss |",
        "|---|---|---|---|---|---|",
    ]
    for i, (name, t) in enumerate(ordered, 1):
        loss = "-" if t.eval_loss is None else f"{t.eval_loss:.4f}"
        values = ", ".join(f"{k}={short_value(v)}" for k, v in t.params.items())
        lines.append(f"| {i} | {name} | {values} | {t.state} | {t.step} | {loss} |")
    return "\n".join(lines) + "\n"
