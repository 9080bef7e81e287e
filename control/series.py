"""The series registry ``<storage>/series/<series>/series.json``: the lineage of runs that retrain one model.

A series is what a platform team retrains on every new drop of data: runs in order, each with the dataset it
trained on, the run it was warm-started from, its score on the series' fixed eval set, and whether it was promoted
to champion. Like the run registry it is a whole-file JSON replaced atomically, and every writer holds the series'
lease (control/lease.py), so a flow and a watchdog finishing two runs of one series never interleave.

The run registry stays the truth about a run's state (``runs/<run>/run.json``); this file holds only lineage.

The champion is published as a pointer, ``series/<series>/champion.json``: which run's final folder, and the sha256
of every file in it. The pointer is replaced atomically and only after the new folder was hashed complete, and
final folders are never rewritten once their run succeeded, so a reader sees the old champion or the new one,
never half of one. Retention never deletes the champion's folder, an active run's, or a folder an active run was
warm-started from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from control import lease as leases
from control import registry
from ray_jobs.config import Config, from_json
from ray_jobs.storage import Layout, exists, fs_and_path, join, read_json, write_json_atomic

log = logging.getLogger("unbroken.series")
T = TypeVar("T")
INIT_FROM = {"series-champion": "champion", "series-latest": "latest"}


def load(storage: str, series: str) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError):
        return read_json(Layout(storage).series_registry(series))
    return None


def _mutate(storage: str, series: str, change: Callable[[dict[str, Any]], T]) -> T:
    """Read (or start) the series record, apply ``change``, write it back -- all under the series' lease."""
    lay = Layout(storage)
    with leases.acquire_wait(storage, f"series {series}", lease_dir=lay.series_lease_dir(series)):
        rec = load(storage, series) or {"series": series, "eval": None, "champion": None, "runs": []}
        out = change(rec)
        rec["updated_at"] = time.time()
        write_json_atomic(lay.series_registry(series), rec)
        return out


def recipe(cfg: Config) -> str:
    """What a run trains besides its data: the model and training settings (not how many samples it prints).
    Two runs with the same dataset and recipe train the same thing."""
    tree = json.loads(cfg.model_dump_json(include={"model", "train"}))
    tree["train"].pop("sample_generations", None)
    if not tree["train"].get("compile"):  # added later: off (the default) hashes as before, so old runs still match
        tree["train"].pop("compile", None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def entry(rec: dict[str, Any] | None, run: str) -> dict[str, Any] | None:
    return next((e for e in (rec or {}).get("runs", []) if e["run"] == run), None)


def state_of(storage: str, run: str) -> str:
    reg = registry.load(storage, run)
    return reg["state"] if reg else "unknown"


def already_trained(cfg: Config, dataset_id: str) -> dict[str, Any] | None:
    """The succeeded run of this series that trained this dataset with this recipe, if any: nothing new to train."""
    rec = load(cfg.storage, cfg.series_name)
    mine = recipe(cfg)
    for e in reversed((rec or {}).get("runs", [])):
        if e["dataset_id"] == dataset_id and e.get("recipe") == mine and state_of(cfg.storage, e["run"]) == "succeeded":
            return e
    return None


def trained_this_recipe(cfg: Config) -> bool:
    """Whether some succeeded run of this series trained with this recipe (on any data): only then can a run of it
    turn out to have nothing new to train."""
    mine = recipe(cfg)
    return any(e.get("recipe") == mine and state_of(cfg.storage, e["run"]) == "succeeded"
               for e in (load(cfg.storage, cfg.series_name) or {}).get("runs", []))  # fmt: skip


def warm_start(cfg: Config) -> dict[str, Any] | None:
    """The run ``model.init_from`` names (the champion, or the newest succeeded run) with its final folder, or None
    for ``base`` and for a series that has no such run yet."""
    which = INIT_FROM.get(cfg.model.init_from)
    if which is None:
        return None
    rec = load(cfg.storage, cfg.series_name) or {}
    if which == "champion":
        run = rec.get("champion")
    else:
        done = [e["run"] for e in rec.get("runs", []) if state_of(cfg.storage, e["run"]) == "succeeded"]
        run = done[-1] if done else None
    if run is None:
        return None
    final = Layout(cfg.storage).final_model(run)
    return {"run": run, "final_model": final, "init_from": cfg.model.init_from}


def pinned_eval(cfg: Config) -> dict[str, Any] | None:
    return (load(cfg.storage, cfg.series_name) or {}).get("eval")


def check_eval_source(cfg: Config) -> None:
    """``series.eval`` must exist before anything is staged or started (a clear error naming the field)."""
    from ray_jobs.config import ConfigError

    if cfg.series.eval and pinned_eval(cfg) is None and not exists(cfg.series.eval):
        raise ConfigError([f"series.eval: no such file or folder: {cfg.series.eval}"])


def begin_run(
    cfg: Config, dataset_id: str, eval_pin: dict[str, Any], parent: dict[str, Any] | None, flow_run_id: str | None
) -> dict[str, Any]:
    """Record the run in its series (once; a resumed run keeps its entry) and pin the series' eval set if this is
    the first run. Returns the pinned eval set (the one every run of the series is scored on)."""

    def change(rec: dict[str, Any]) -> dict[str, Any]:
        rec["eval"] = rec.get("eval") or eval_pin
        e = entry(rec, cfg.name)
        if e is None:
            e = {"run": cfg.name, "dataset_id": dataset_id, "recipe": recipe(cfg), "started_at": time.time(),
                 "parent": parent["run"] if parent else None, "init_from": cfg.model.init_from,
                 "score": None, "verdict": None}  # fmt: skip
            rec["runs"].append(e)
        e["flow_run_id"] = flow_run_id or e.get("flow_run_id")
        return rec["eval"]

    return _mutate(cfg.storage, cfg.series_name, change)


def run_of_flow_run(storage: str, series: str, flow_run_id: str) -> str | None:
    """Which run a flow run resolved its name template to (its cancel/crash hooks need it)."""
    rec = load(storage, series) or {}
    return next((e["run"] for e in rec.get("runs", []) if e.get("flow_run_id") == flow_run_id), None)


# -- the promotion gate ---------------------------------------------------------------------------------------
def decide(score: float, champion_score: float | None, min_improvement: float) -> tuple[bool, str]:
    """(promote?, why). A challenger must beat the champion's score on the same eval set by ``min_improvement``
    (relative); the first scored run of a series is champion."""
    if champion_score is None:
        return True, f"first scored run of the series (eval loss {score:.4f})"
    bar = champion_score * (1 - min_improvement)
    if score < bar:
        return True, f"eval loss {score:.4f} beats the champion's {champion_score:.4f} (needed < {bar:.4f})"
    return False, f"eval loss {score:.4f} does not beat the champion's {champion_score:.4f} (needed < {bar:.4f})"


def folder_manifest(url: str) -> dict[str, str]:
    """sha256 of every file under a folder (relative path -> digest)."""
    fs, path = fs_and_path(url)
    fs.invalidate_cache(path)
    out = {}
    for f in sorted(fs.find(path)):
        h = hashlib.sha256()
        with fs.open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f[len(path.rstrip("/")) + 1 :]] = h.hexdigest()
    return out


def champion(storage: str, series: str) -> dict[str, Any] | None:
    """The published champion pointer, or None."""
    with contextlib.suppress(FileNotFoundError):
        return read_json(Layout(storage).champion(series))
    return None


def finish_run(storage: str, run: str) -> dict[str, Any] | None:
    """A run succeeded: score it against the champion, publish it if it wins, apply retention. Called by whoever
    closes the run (the finetune flow, or the watchdog for a run it restarted); the first caller decides and emits
    the event, a later one gets the same verdict. None for a run without a series entry (one started before
    series existed)."""
    reg = registry.load(storage, run)
    cfg = from_json(json.dumps(reg["config"]))
    series = cfg.series_name
    if entry(load(storage, series), run) is None:  # not started as part of a lineage: nothing to gate or trim
        return None
    score = _read_score(storage, run)
    # Hashed before the lease is taken (a big model's folder takes a while); the folder no longer changes.
    files = folder_manifest(Layout(storage).final_model(run)) if score is not None else {}

    def change(rec: dict[str, Any]) -> dict[str, Any] | None:
        e = entry(rec, run)
        if e is None or e.get("verdict"):  # no lineage, or already decided by another closer
            return None
        e["ended_at"], e["score"] = time.time(), score
        champ = entry(rec, rec["champion"]) if rec.get("champion") else None
        if score is None:
            verdict = {"promoted": False, "why": "no score on the series' eval set (score.json missing)"}
        else:
            promote, why = decide(score, champ["score"] if champ else None, cfg.series.min_improvement)
            verdict = {"promoted": promote, "why": why}
        verdict |= {"run": run, "series": series, "score": score,
                    "champion": champ["run"] if champ else None, "champion_score": champ["score"] if champ else None}  # fmt: skip
        if verdict["promoted"]:
            _publish(storage, series, run, score, files)
            rec["champion"] = run
        e["verdict"] = verdict
        _trim_runs(storage, rec, cfg.series.keep_runs)
        return verdict

    verdict = _mutate(storage, series, change)
    trim_checkpoints(storage, run, cfg.checkpoint.keep_after_success)
    if verdict is None:
        return (entry(load(storage, series), run) or {}).get("verdict")
    _emit(verdict)
    return verdict


def _read_score(storage: str, run: str) -> float | None:
    with contextlib.suppress(FileNotFoundError):
        return read_json(Layout(storage).score(run))["eval_loss"]
    return None


def _publish(storage: str, series: str, run: str, score: float, files: dict[str, str]) -> None:
    folder = Layout(storage).final_model(run)
    if "config.json" not in files or "README.md" not in files:  # README.md is written last (upload_dir)
        raise FileNotFoundError(f"run {run}'s final folder {folder} is incomplete; not publishing it")
    pointer = {"run": run, "folder": folder, "score": score, "files": files, "published_at": time.time()}
    write_json_atomic(Layout(storage).champion(series), pointer)


def _emit(verdict: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):  # no Prefect API reachable: the verdict is in the series registry anyway
        from prefect.events import emit_event

        kind = "promoted" if verdict["promoted"] else "rejected"
        emit_event(
            event=f"unbroken.model.{kind}",
            resource={"prefect.resource.id": f"unbroken.series.{verdict['series']}"},
            related=[{"prefect.resource.id": f"unbroken.run.{verdict['run']}", "prefect.resource.role": "run"}],
            payload=verdict,
        )


# -- retention ------------------------------------------------------------------------------------------------
def trim_checkpoints(storage: str, run: str, keep: int) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints of a succeeded run; returns what was deleted."""
    from ray_jobs import checkpoint as ckpt

    if registry.load(storage, run)["state"] != "succeeded":
        return []
    doomed = [url for _, url in ckpt.list_checkpoints(Layout(storage).checkpoints_dir(run))[keep:]]
    for url in doomed:
        _remove_folder(url)
    if doomed:
        log.info("run %s succeeded: deleted %d older checkpoint(s), kept %d", run, len(doomed), keep)
    return doomed


def _remove_folder(url: str) -> None:
    fs, path = fs_and_path(url)
    fs.rm(path, recursive=True)


def _trim_runs(storage: str, rec: dict[str, Any], keep_runs: int | None) -> None:
    """Delete the final folders of the oldest succeeded runs beyond ``keep_runs``: never the champion's, an active
    run's, or the folder an active run was warm-started from."""
    if keep_runs is None:
        return
    states = {e["run"]: state_of(storage, e["run"]) for e in rec["runs"]}
    protected = {rec.get("champion")} | {e["parent"] for e in rec["runs"] if states[e["run"]] in registry.ACTIVE}
    done = [e for e in rec["runs"] if states[e["run"]] == "succeeded" and e["run"] not in protected]
    for e in done[: max(0, len(done) - keep_runs)]:
        final = Layout(storage).final_model(e["run"])
        if exists(final):
            _remove_folder(final)
            e["final_deleted_at"] = time.time()
            log.info("series %s: deleted the final model of run %s (series.keep_runs=%d)", rec["series"], e["run"],
                     keep_runs)  # fmt: skip


# -- what people read -------------------------------------------------------------------------------------------
def table(storage: str, series: str | None = None) -> list[dict[str, Any]]:
    """One row per run of every series (or one): run, series, state, dataset, score, parent, champion mark."""
    names = [series] if series else _series_names(storage)
    rows = []
    for s in names:
        rec = load(storage, s) or {"runs": []}
        for e in rec["runs"]:
            verdict = e.get("verdict") or {}
            rows.append({"series": s, "run": e["run"], "state": state_of(storage, e["run"]),
                         "dataset": e["dataset_id"], "score": e.get("score"), "parent": e.get("parent"),
                         "champion": rec.get("champion") == e["run"], "verdict": verdict.get("why"),
                         "started_at": e.get("started_at")})  # fmt: skip
    return rows


def _series_names(storage: str) -> list[str]:
    fs, path = fs_and_path(join(storage, "series"))
    fs.invalidate_cache(path)
    try:
        return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs in any series"
    head = f"{'series':<16} {'run':<28} {'state':<11} {'dataset':<20} {'eval loss':>9}  {'parent':<28} champion"
    lines = [head]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.4f}"
        lines.append(f"{r['series']:<16} {r['run']:<28} {r['state']:<11} {r['dataset']:<20} {score:>9}  "
                     f"{r['parent'] or '-':<28} {'*' if r['champion'] else ''}")  # fmt: skip
    return "\n".join(lines)


def lineage_lines(storage: str, run: str) -> list[str]:
    """What ``unbroken status`` says of a run's series: its parent and the promotion verdict."""
    reg = registry.load(storage, run)
    if reg is None or "config" not in reg:
        return []
    name = from_json(json.dumps(reg["config"])).series_name
    rec = load(storage, name)
    e = entry(rec, run)
    if e is None:
        return []
    verdict = e.get("verdict")
    said = "not decided yet" if not verdict else ("promoted" if verdict["promoted"] else "not promoted")
    lines = [f"series {name}: warm start from {e['parent'] or 'the base model'} (model.init_from={e['init_from']})",
             f"  promotion: {said}{' -- ' + verdict['why'] if verdict else ''}"]  # fmt: skip
    if rec.get("champion"):
        lines.append(f"  champion: {rec['champion']}{' (this run)' if rec['champion'] == run else ''}")
    return lines
