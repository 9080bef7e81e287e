"""What people read of the series: the runs table (``unbroken runs``, the series artifact) and a run's lineage
lines (``unbroken status``)."""

from __future__ import annotations

from typing import TypedDict

from pydantic import JsonValue

from control import registry
from control.records.series import SeriesRecord, SeriesRun
from control.series.lineage import load, state_of
from ray_jobs.storage import fs_and_path, join


class SeriesRow(TypedDict):
    """A run of a series as people read it: a plain dict (what the CLI prints and a Prefect table artifact takes)."""

    series: str
    run: str
    state: str  # its run record's (the truth about a run), "unknown" without one
    dataset: str
    score: float | None  # eval loss on the series' pinned eval set, once scored
    parent: str | None  # the run it was warm-started from; None: the base model
    champion: bool
    verdict: str | None  # the promotion gate's reason
    started_at: float | None
    search: str | None  # a trial's search
    params: dict[str, JsonValue] | None  # a trial's drawn values
    steps: int | None  # a trial's last reported step


def table(storage: str, series: str | None = None) -> list[SeriesRow]:
    """One row per run of every series (or one): run, series, state, dataset, score, parent, champion mark."""
    names = [series] if series else _series_names(storage)
    rows = []
    for s in names:
        rec = load(storage, s) or SeriesRecord.new(s)
        rows += [_row(storage, rec, e) for e in rec.runs]
    return rows


def _row(storage: str, rec: SeriesRecord, e: SeriesRun) -> SeriesRow:
    return {
        "series": rec.series,
        "run": e.run,
        "state": state_of(storage, e.run),
        "dataset": e.dataset_id,
        "score": e.score,
        "parent": e.parent,
        "champion": rec.champion == e.run,
        "verdict": e.verdict.why if e.verdict else None,
        "started_at": e.started_at,
        "search": e.search,
        "params": e.params,
        "steps": e.steps,
    }


def _series_names(storage: str) -> list[str]:
    fs, path = fs_and_path(join(storage, "series"))
    fs.invalidate_cache(path)
    try:
        return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def format_table(rows: list[SeriesRow]) -> str:
    if not rows:
        return "no runs in any series"
    head = f"{'series':<16} {'run':<28} {'state':<13} {'dataset':<20} {'eval loss':>9}  {'parent':<28} champion"
    lines = [head]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.4f}"
        run = f"  {r['run']}" if r.get("search") else r["run"]  # a search's trials under it
        lines.append(
            f"{r['series']:<16} {run:<28} {r['state']:<13} {r['dataset']:<20} {score:>9}  "
            f"{r['parent'] or '-':<28} {'*' if r['champion'] else ''}{_params(r)}"
        )
    return "\n".join(lines)


def short_value(v: JsonValue) -> JsonValue:
    """A drawn value as people read it: a float to 4 significant digits."""
    return float(f"{v:.4g}") if isinstance(v, float) else v


def _params(r: SeriesRow) -> str:
    """A trial's values (and the step it was stopped at), after the row."""
    params = r["params"]
    if not params:
        return ""
    values = ", ".join(f"{k}={short_value(v)}" for k, v in params.items())
    stopped = f" (stopped at step {r['steps']})" if r["state"] == "stopped-early" and r.get("steps") else ""
    return f"  {values}{stopped}"


def lineage_lines(storage: str, run: str) -> list[str]:
    """What ``unbroken status`` says of a run's series: its parent and the promotion verdict."""
    reg = registry.load(storage, run)
    if reg is None or not reg.config:
        return []
    name = reg.cfg().series_name
    rec = load(storage, name)
    e = rec.entry(run) if rec else None
    if rec is None or e is None:
        return []
    verdict = e.verdict
    said = "not decided yet" if not verdict else ("promoted" if verdict.promoted else "not promoted")
    search = rec.entry(e.search) if e.search else None
    if search is not None and not verdict:  # a trial: only its search's winner is put to the gate
        said = f"not judged: only the winner of search {e.search} is ({search.winner or 'not known yet'})"
    lines = [
        f"series {name}: warm start from {e.parent or 'the base model'} (model.init_from={e.init_from})",
        f"  promotion: {said}{' -- ' + verdict.why if verdict else ''}",
    ]
    if rec.champion:
        lines.append(f"  champion: {rec.champion}{' (this run)' if rec.champion == run else ''}")
    return lines
