"""The promotion gate: a run that succeeded is scored against the series' champion and, if it wins, published.

The champion is published as a pointer, ``series/<series>/champion.json``: which run's final folder, and the sha256
of every file in it. The pointer is replaced atomically and only after the new folder was hashed complete, and
final folders are never rewritten once their run succeeded, so a reader sees the old champion or the new one,
never half of one.
"""

from __future__ import annotations

import contextlib
import time

from control import registry
from control.records.series import ChampionPointer, SeriesRecord, SeriesRun, Verdict
from control.series.lineage import load, mutate
from control.series.retention import trim_checkpoints, trim_runs
from ray_jobs.config import Config
from ray_jobs.storage import Layout, as_url, file_sha256, fs_and_path, read_json, write_json_atomic


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
    prefix = len(path.rstrip("/")) + 1
    return {f[prefix:]: file_sha256(as_url(url, f)) for f in sorted(fs.find(path))}


def champion(storage: str, series: str) -> ChampionPointer | None:
    """The published champion pointer, or None."""
    return ChampionPointer.read(Layout(storage).champion(series))


def finish_run(storage: str, run: str) -> Verdict | None:
    """A run succeeded: score it against the champion, publish it if it wins, apply retention. Called by whoever
    closes the run (the finetune flow, or the watchdog for a run it restarted); the first caller decides and emits
    the event, a later one gets the same verdict. None for a run without a series entry (one started before
    series existed). FileNotFoundError when the run has no record."""
    cfg = registry.load_existing(storage, run).cfg()
    series = cfg.series_name
    if _entry(storage, series, run) is None:  # not started as part of a lineage: nothing to gate or trim
        return None
    score = score_of(storage, run)
    # Hashed before the lease is taken (a big model's folder takes a while); the folder no longer changes.
    files = folder_manifest(Layout(storage).final_model(run)) if score is not None else {}
    verdict = mutate(storage, series, lambda rec: _close(storage, rec, cfg, score, files))
    trim_checkpoints(storage, run, cfg.checkpoint.keep_after_success)
    if verdict is None:  # another closer decided: its verdict, as recorded
        e = _entry(storage, series, run)
        return e.verdict if e else None
    _emit(verdict)
    return verdict


def scored(storage: str, run: str) -> bool:
    """Whether the run's place in its series is settled: judged by the promotion gate, or it has no entry to judge."""
    reg = registry.load(storage, run)
    if reg is None:
        return True
    e = _entry(storage, reg.cfg().series_name, run)
    return e is None or e.verdict is not None


def _entry(storage: str, series: str, run: str) -> SeriesRun | None:
    rec = load(storage, series)
    return rec.entry(run) if rec else None


def _close(storage: str, rec: SeriesRecord, cfg: Config, score: float | None, files: dict[str, str]) -> Verdict | None:
    """Under the series' lease: record the run's end and score, judge it, publish it if it won, trim old finals.
    None when the run has no entry or was already judged."""
    e = rec.entry(cfg.name)
    if e is None or e.verdict is not None:  # no lineage, or already decided by another closer
        return None
    e.set(ended_at=time.time(), score=score)
    verdict = _judge(rec, cfg, score)
    if verdict.promoted:
        assert score is not None, "_judge promotes only a scored run"
        _publish(storage, cfg.series_name, cfg.name, score, files)
        rec.champion = cfg.name
    e.verdict = verdict
    trim_runs(storage, rec, cfg.series.keep_runs)
    return verdict


def _judge(rec: SeriesRecord, cfg: Config, score: float | None) -> Verdict:
    champ = rec.champion_entry()
    champion_score = champ.score if champ else None
    if score is None:
        promote, why = False, "no score on the series' eval set (score.json missing)"
    else:
        promote, why = decide(score, champion_score, cfg.series.min_improvement)
    return Verdict(
        promoted=promote,
        why=why,
        run=cfg.name,
        series=cfg.series_name,
        score=score,
        champion=champ.run if champ else None,
        champion_score=champion_score,
    )


def score_of(storage: str, run: str) -> float | None:
    """The run's loss on its series' eval set (``runs/<run>/score.json``), or None when it left none."""
    with contextlib.suppress(FileNotFoundError):
        return read_json(Layout(storage).score(run))["eval_loss"]
    return None


def _publish(storage: str, series: str, run: str, score: float, files: dict[str, str]) -> None:
    folder = Layout(storage).final_model(run)
    model = "config.json" in files or "adapter_config.json" in files  # a model, or an adapter (train.export)
    if not model or "README.md" not in files:  # README.md is written last (upload_dir)
        raise FileNotFoundError(f"run {run}'s final folder {folder} is incomplete; not publishing it")
    pointer = ChampionPointer(
        schema_version=ChampionPointer.SCHEMA,
        run=run,
        folder=folder,
        score=score,
        files=files,
        published_at=time.time(),
    )
    write_json_atomic(Layout(storage).champion(series), pointer.dump(), durable=True)


def _emit(verdict: Verdict) -> None:
    """The verdict as a Prefect event (``unbroken.model.promoted`` / ``rejected``) for automations to act on."""
    with contextlib.suppress(Exception):  # no Prefect API reachable: the verdict is in the series registry anyway
        # Imported here, not at the top: the control plane is Prefect-free at import (the watchdog's policy, the
        # CLI's status and runs import it without paying for Prefect); only the flow-facing edges import it lazily.
        from prefect.events import emit_event

        kind = "promoted" if verdict.promoted else "rejected"
        emit_event(
            event=f"unbroken.model.{kind}",
            resource={"prefect.resource.id": f"unbroken.series.{verdict.series}"},
            related=[{"prefect.resource.id": f"unbroken.run.{verdict.run}", "prefect.resource.role": "run"}],
            payload=verdict.dump(),
        )
