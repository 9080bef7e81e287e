"""Summarize a finished run: metrics into Prefect artifacts, eval loss first vs last, the sample generations
published (the training job wrote them: ray_jobs/train/samples.py; nothing here loads a model)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from control.logs import run_logger
from control.summaries import RunSummary, TableRow
from ray_jobs.config import Config
from ray_jobs.contracts.base import RecordError
from ray_jobs.contracts.metrics import MetricsRow
from ray_jobs.contracts.samples import Sample, Samples
from ray_jobs.contracts.tracking import TrackingLinks
from ray_jobs.secrets import mask_tree
from ray_jobs.storage import Layout

if TYPE_CHECKING:
    from control.series import SeriesRow

METRIC_COLUMNS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen")
CHART_POINTS = 60  # mermaid renders a few dozen points legibly
TABLE_ROWS = 200  # rows of an artifact table (metrics, eval losses): long runs are thinned evenly
# A line colour that stands out on the UI's code-block background (mermaid's default is a pale yellow).
CHART_THEME = '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "#ff6b35"}}}}%%'


def thin(items: list, limit: int) -> list:
    """At most about ``limit`` of ``items``, evenly spaced, always keeping the first and the last: artifacts of a
    100k-step run stay the size of a short run's."""
    if len(items) <= limit:
        return items
    every = -(-len(items) // limit)
    return items[::every] + ([items[-1]] if (len(items) - 1) % every else [])


def metrics_table(cfg: Config, rows: list[MetricsRow]) -> list[TableRow]:
    """The logged steps (thinned to ``TABLE_ROWS``), with the checkpoint (if any) written at each step."""
    from ray_jobs import checkpoint as ckpt

    saved = {
        step: url.rstrip("/").rsplit("/", 1)[-1]
        for step, url in ckpt.list_checkpoints(Layout(cfg.storage).checkpoints_dir(cfg.name))
    }
    return [
        {**{k: r.get(k) for k in METRIC_COLUMNS}, "checkpoint": saved.get(r["step"], "")}
        for r in thin(rows, TABLE_ROWS)
    ]


def mermaid_line(title: str, y_label: str, points: list[tuple[str, float]], top: float) -> list[str]:
    """A mermaid ``xychart-beta`` line chart (the Prefect UI renders mermaid in markdown artifacts); the axes only
    when there are points."""
    return mermaid_chart(title, y_label, [x for x, _ in points], [[y for _, y in points]] if points else [], top)


def mermaid_chart(
    title: str, y_label: str, xs: list[str], lines: list[list[float]], top: float, theme: str = CHART_THEME
) -> list[str]:
    """A mermaid ``xychart-beta`` chart of one or more lines over the same x labels (a shorter line stops early);
    the axes only when there are lines."""
    out = ["```mermaid", theme, "xychart-beta", f'    title "{title}"']
    if xs and lines:
        out += [f"    x-axis [{', '.join(xs)}]", f'    y-axis "{y_label}" 0 --> {top * 1.05:.3f}']
        out += ["    line [" + ", ".join(f"{y:.4f}" for y in ys) + "]" for ys in lines]
    return [*out, "```"]


def loss_chart_markdown(cfg: Config, rows: list[MetricsRow]) -> str:
    """Train and eval loss by step as a mermaid ``xychart-beta`` line chart (the Prefect UI renders mermaid)."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    train, evals = thin(train, CHART_POINTS), thin(evals, TABLE_ROWS)
    top = max([r["loss"] for r in train] + [r["eval_loss"] for r in evals], default=0.0)
    points = [(str(r["step"]), r["loss"]) for r in train]
    lines = [
        f"# Loss of {cfg.name}",
        "",
        *mermaid_line(f"{cfg.name}: loss by step", "loss", points, top),
        "",
        "Train loss at each logged step (the line). Eval loss:",
        "",
        "| step | eval loss |",
        "|---|---|",
    ]
    lines += [f"| {r['step']} | {r['eval_loss']:.4f} |" for r in evals]
    return "\n".join(lines) + "\n"


def read_metrics(cfg: Config) -> list[MetricsRow]:
    from ray_jobs.train.metrics import read_rows

    return read_rows(Layout(cfg.storage).metrics(cfg.name))


def summary_markdown(cfg: Config, s: RunSummary) -> str:
    lines = [
        f"# Run `{cfg.name}`",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {s['steps']} |",
        f"| eval loss at step 0 | {s['first_eval_loss']:.4f} |",
        f"| eval loss at the end | {s['final_eval_loss']:.4f} |",
        f"| final train loss | {s['final_train_loss']:.4f} |",
        f"| held-out exact match | {s['exact_match']} |",
        f"| dataset | `{s['dataset_id']}` |",
        f"| final model | `{s['final_model']}` |",
        "",
        "| prompt | target | base model | fine-tuned |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{_cell(x['prompt'])}` | `{_cell(x['target'])}` | `{_cell(x['before'])}` | `{_cell(x['output'])}` |"
        for x in s["samples"][:8]
    ]
    return "\n".join(lines)


def tracking_markdown(links: TrackingLinks) -> str:
    """Where the run's experiment trackers are (``runs/<run>/tracking.json``, written by rank 0 as each opened)."""
    lines = ["# Experiment tracking", "", "| tracker | where | to look |", "|---|---|---|"]
    for name in sorted(links.trackers):
        where = ", ".join(f"{k} `{v}`" for k, v in links.where(name).items())
        lines.append(f"| {name} | {_cell(where)} | `{_cell(links.look(name))}` |")
    return "\n".join(lines)


def publish_tracking(cfg: Config) -> None:
    """The tracker links as an artifact, and a link artifact for a tracker with a web page (an MLflow server)."""
    try:
        links = TrackingLinks.read(Layout(cfg.storage).tracking(cfg.name)) if cfg.tracking.enabled else None
    except RecordError as e:  # torn or hand-edited: the run's report goes on without its trackers' links
        run_logger().warning("no tracking artifact: %s", e)
        return
    if links is None or not links.trackers:
        return
    # a tracker's URI shown, never its credentials (the file holds them masked already)
    links = TrackingLinks(trackers=mask_tree(links.trackers))
    create_markdown_artifact(tracking_markdown(links), key=f"{cfg.name}-tracking", description="experiment trackers")
    for name, got in links.trackers.items():
        if got.get("url"):
            create_link_artifact(got["url"], link_text=f"{name} run", key=f"{cfg.name}-{name}")


def _cell(text: str) -> str:
    """Text for one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def read_samples(cfg: Config) -> list[Sample]:
    """The sample generations the run's job wrote after its export; none (said in the log) when it wrote none."""
    url = Layout(cfg.storage).samples(cfg.name)
    try:
        found = Samples.read(url)
    except RecordError as e:
        run_logger().warning("sample generations not shown: %s", e)
        return []
    if found is None:
        run_logger().warning("no sample generations: the job wrote no %s", url)
        return []
    return found.samples


@task(name="summarize", cache_policy=NO_CACHE)
def summarize(cfg: Config, dataset_id: str) -> RunSummary:
    """Metrics table, summary and final-model link as artifacts; returns the numbers the CLI prints."""
    rows = read_metrics(cfg)
    evals = [r for r in rows if "eval_loss" in r]
    losses = [r for r in rows if "loss" in r]
    final = Layout(cfg.storage).final_model(cfg.name)
    samples = read_samples(cfg)
    s: RunSummary = {
        "run": cfg.name,
        "dataset_id": dataset_id,
        "steps": int(rows[-1]["step"]) if rows else 0,
        "first_eval_loss": evals[0]["eval_loss"],
        "final_eval_loss": evals[-1]["eval_loss"],
        "final_train_loss": losses[-1]["loss"] if losses else float("nan"),
        "exact_match": f"{sum(x['exact'] for x in samples)}/{len(samples)}" if samples else "n/a",
        "samples": samples,
        "final_model": final,
    }
    create_table_artifact(metrics_table(cfg, rows), key=f"{cfg.name}-metrics", description="logged steps")
    create_markdown_artifact(loss_chart_markdown(cfg, rows), key=f"{cfg.name}-loss-curve", description="loss curve")
    create_markdown_artifact(summary_markdown(cfg, s), key=f"{cfg.name}-summary", description="run summary")
    create_link_artifact(final, link_text="final model folder", key=f"{cfg.name}-final-model")
    publish_tracking(cfg)
    run_logger().info(
        "eval loss %.4f at step 0 -> %.4f at step %d; exact match %s",
        s["first_eval_loss"],
        s["final_eval_loss"],
        s["steps"],
        s["exact_match"],
    )
    return s


def series_chart_markdown(series: str, rows: list[SeriesRow]) -> str:
    """Each scored run's loss on the series' fixed eval set, in order, as a mermaid line chart; the champion named."""
    scores = [r["score"] for r in rows if r["score"] is not None]
    lines = [
        f"# Series {series}",
        "",
        f"Runs: {len(rows)}; champion: {next((r['run'] for r in rows if r['champion']), 'none yet')}",
        "",
    ]
    if scores:
        points = [(str(i), score) for i, score in enumerate(scores, 1)]
        title = f"{series}: eval loss on the series eval set, by run"
        lines += [*mermaid_line(title, "eval loss", points, max(y for _, y in points)), ""]
    lines += ["| # | run | dataset | eval loss | warm start from | verdict |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        score = "-" if r["score"] is None else f"{r['score']:.4f}"
        mark = " (champion)" if r["champion"] else ""
        lines.append(
            f"| {i} | {r['run']}{mark} | {r['dataset']} | {score} | {r['parent'] or 'base'} | {r['verdict'] or '-'} |"
        )
    return "\n".join(lines)


async def publish_series(cfg: Config) -> None:
    """The series' lineage as a table artifact and its eval loss across runs as a chart (key ``series-<name>``)."""
    from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

    from control import series

    rows = series.table(cfg.storage, cfg.series_name)
    table = [{k: r[k] for k in ("run", "state", "dataset", "score", "parent", "champion", "verdict")} for r in rows]
    await acreate_table_artifact(
        table, key=f"series-{cfg.series_name}", description=f"runs of series {cfg.series_name}"
    )
    await acreate_markdown_artifact(
        series_chart_markdown(cfg.series_name, rows),
        key=f"series-{cfg.series_name}-chart",
        description="eval loss across the series",
    )
