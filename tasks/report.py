"""Summarize a finished run: metrics into Prefect artifacts, eval loss first vs last, sample generations."""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from ray_jobs.config import Config
from ray_jobs.storage import Layout, read_bytes
from tasks.logs import run_logger

METRIC_COLUMNS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen")
CHART_POINTS = 60  # mermaid renders a few dozen points legibly
# A line colour that stands out on the UI's code-block background (mermaid's default is a pale yellow).
CHART_THEME = '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "#ff6b35"}}}}%%'


def metrics_table(cfg: Config, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logged steps, with the checkpoint (if any) written at each step."""
    from ray_jobs import checkpoint as ckpt

    saved = {step: url.rstrip("/").rsplit("/", 1)[-1] for step, url in ckpt.list_checkpoints(
        Layout(cfg.storage).checkpoints_dir(cfg.name))}  # fmt: skip
    return [{**{k: r.get(k) for k in METRIC_COLUMNS}, "checkpoint": saved.get(r["step"], "")} for r in rows]


def loss_chart_markdown(cfg: Config, rows: list[dict[str, Any]]) -> str:
    """Train and eval loss by step as a mermaid ``xychart-beta`` line chart (the Prefect UI renders mermaid)."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    if len(train) > CHART_POINTS:  # evenly thinned, always keeping the last point
        every = -(-len(train) // CHART_POINTS)
        train = train[::every] + ([train[-1]] if (len(train) - 1) % every else [])
    lines = [
        f"# Loss of {cfg.name}",
        "",
        "```mermaid",
        CHART_THEME,
        "xychart-beta",
        f'    title "{cfg.name}: loss by step"',
    ]
    if train:
        top = max([r["loss"] for r in train] + [r["eval_loss"] for r in evals])
        lines += [
            f"    x-axis [{', '.join(str(r['step']) for r in train)}]",
            f'    y-axis "loss" 0 --> {top * 1.05:.3f}',
            "    line [" + ", ".join(f"{r['loss']:.4f}" for r in train) + "]",
        ]
    lines += [
        "```",
        "",
        "Train loss at each logged step (the line). Eval loss:",
        "",
        "| step | eval loss |",
        "|---|---|",
    ]
    lines += [f"| {r['step']} | {r['eval_loss']:.4f} |" for r in evals]
    return "\n".join(lines) + "\n"


def read_metrics(cfg: Config) -> list[dict[str, Any]]:
    text = read_bytes(Layout(cfg.storage).metrics(cfg.name)).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def eval_examples(cfg: Config, limit: int) -> list[tuple[str, str]]:
    """Up to ``limit`` (prompt, target) pairs from the held-out eval split, in source order."""
    from ray_jobs.data.staging import parse_records, read_sources, record_in_eval

    if cfg.data.eval:
        files, keep = read_sources(cfg.data.eval, "data.eval"), lambda r: True
    else:
        files, keep = read_sources(cfg.data.train, "data.train"), lambda r: record_in_eval(r, cfg.data.eval_fraction)
    out = []
    for f in files:
        out += [(r.prompt, r.target) for r in parse_records(f, cfg.data)[0] if keep(r)]
        if len(out) >= limit:
            break
    return out[:limit]


def generate_samples(model_url: str, cfg: Config, n: int = 64) -> list[dict[str, Any]]:
    """Greedy completions of held-out prompts by the final model (loaded with plain transformers).

    Only for ``pairs`` data, where a prompt and its expected completion are explicit.
    """
    import torch

    if cfg.data.format != "pairs":
        return []

    from ray_jobs.model.loading import load_model, load_tokenizer

    tok = load_tokenizer(model_url, cfg.data.cache_dir)
    model = load_model(model_url, cfg.data.cache_dir).eval()
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    samples = []
    for prompt, target in eval_examples(cfg, n):
        ids = torch.tensor([bos + tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=len(tok(target)["input_ids"]) + 4, do_sample=False, pad_token_id=tok.pad_token_id
            )
        got = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        samples.append({"prompt": prompt, "target": target, "output": got, "exact": got.strip() == target.strip()})
    return samples


def summary_markdown(cfg: Config, s: dict[str, Any]) -> str:
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
        "| prompt | target | model output |",
        "|---|---|---|",
    ]
    lines += [f"| `{x['prompt']}` | `{x['target']}` | `{x['output']}` |" for x in s["samples"][:8]]
    return "\n".join(lines)


@task(name="summarize", cache_policy=NO_CACHE)
def summarize(cfg: Config, dataset_id: str) -> dict[str, Any]:
    """Metrics table, summary and final-model link as artifacts; returns the numbers the CLI prints."""
    rows = read_metrics(cfg)
    evals = [r for r in rows if "eval_loss" in r]
    losses = [r for r in rows if "loss" in r]
    final = Layout(cfg.storage).final_model(cfg.name)
    samples = generate_samples(final, cfg)
    s = {
        "run": cfg.name,
        "dataset_id": dataset_id,
        "steps": rows[-1]["step"] if rows else 0,
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
    run_logger().info(
        "eval loss %.4f at step 0 -> %.4f at step %d; exact match %s",
        s["first_eval_loss"], s["final_eval_loss"], s["steps"], s["exact_match"],
    )  # fmt: skip
    return s
