"""A hyperparameter search in its series: its trials are runs of the series, its winner goes through the gate.

The search's entry in the series record lists its trials; each trial has an entry of its own (its values, how it
ended, its score on the series' eval set), so the lineage shows the search as one entry with its children. Once
the search's job succeeded, whoever closes it (the tune flow, or the watchdog for a search it restarted) brings the
trials' run records up to date from ``runs/<search>/trials.json``, picks the winner (the completed trial with the
lowest eval loss by the search's metric) and puts the winner to the promotion gate exactly as a retraining run.
"""

from __future__ import annotations

import contextlib
import json
import time

from control import lifecycle, registry
from control.records.run import RunRecord, State
from control.records.series import SeriesRecord, Verdict
from control.series import promotion
from control.series.lineage import mutate
from control.series.retention import trim_checkpoints
from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.contracts.trials import TrialEntry, TrialState
from ray_jobs.search.trials import Trial, trial_states, trials
from ray_jobs.storage import Layout, exists

# A trial's state in trials.json -> its run record's state
RUN_STATE: dict[TrialState, State] = {"pending": "submitted", "running": "running", "completed": "succeeded", "stopped-early": "stopped-early",
             "failed": "failed"}  # fmt: skip


def record_trials(cfg: Config, dataset_id: str, inputs: AttemptInputs) -> list[Trial]:
    """Each trial's run record (``unbroken runs`` and ``status`` show a trial like any run): written once, when
    the search first starts; ``inputs``: the search's (its manifest, base model and eval set), which every trial shares."""
    out = trials(cfg)
    for t in out:
        if registry.load(cfg.storage, t.name) is None:
            reg = RunRecord(
                name=t.name,
                created_at=time.time(),
                config=json.loads(t.config.model_dump_json()),
                dataset_id=dataset_id,
                search=cfg.name,
                params=t.params,
                inputs=inputs,
            )
            registry.save(cfg.storage, t.name, reg)
    return out


def sync_trials(storage: str, search: str) -> dict[str, TrialEntry]:
    """The trials as the search job last wrote them, with each trial's run record brought up to date (state, final
    model). Only whoever closes or watches the search writes trial records; the job writes trials.json."""
    found = trial_states(storage, search)
    for name, info in found.items():
        reg = registry.load(storage, name)
        if reg is None:
            continue
        state = RUN_STATE[info.state]
        final = Layout(storage).final_model(name)
        final_model = final if state == "succeeded" and exists(final) else None
        if (reg.state, reg.final_model) != (state, final_model):
            lifecycle.move(reg, state)
            reg.final_model = final_model
            registry.save(storage, name, reg)
    return found


def end_unfinished(storage: str, search: str, why: str) -> list[str]:
    """The search ended without finishing (cancelled, or the watchdog gave up): every trial not yet over is
    ``failed`` with ``why``, so no trial record says ``running`` forever. Returns those trials."""
    sync_trials(storage, search)
    reg = registry.load(storage, search)
    ended = []
    for name in reg.trials if reg else []:
        trial = registry.load(storage, name)
        if trial is not None and trial.state in ("submitted", "running"):
            lifecycle.move(trial, "failed")
            trial.reason = why
            registry.save(storage, name, trial)
            ended.append(name)
    return ended


def lost_steps(storage: str, search: str) -> int:
    """Steps the search's running trials trained past their newest valid checkpoints (what a restart trains again),
    from each trial's heartbeat: the search's own heartbeat sums every trial's steps, not what is lost."""
    from ray_jobs import checkpoint as ckpt

    lost = 0
    for name, t in trial_states(storage, search).items():
        if t.state != "running":
            continue
        # torn, a newer release's (RecordError), or gone mid-listing: nothing counted from it
        with contextlib.suppress(FileNotFoundError, ValueError):
            beat = Beat.read(Layout(storage).heartbeat(name))
            if beat is None:  # no heartbeat yet: nothing trained, nothing lost (its checkpoints not read)
                continue
            found = ckpt.find_latest_valid(Layout(storage).checkpoints_dir(name))
            lost += max(0, beat.step - (ckpt.checkpoint_step(found[0]) if found else 0))
    return lost


def winner(found: dict[str, TrialEntry]) -> str | None:
    """The completed trial with the lowest eval loss (the lower index on a tie), or None when none completed."""
    done = [
        (t.eval_loss, t.index, name) for name, t in found.items() if t.state == "completed" and t.eval_loss is not None
    ]
    return min(done)[2] if done else None


def finish_search(storage: str, search: str) -> Verdict | None:
    """The search's job succeeded: its trials recorded, their checkpoints trimmed, the winner put to the gate."""
    cfg = registry.load_existing(storage, search).cfg()
    found = sync_trials(storage, search)
    best = winner(found)
    mutate(storage, cfg.series_name, lambda rec: _record_trials(storage, rec, search, found, best))
    for name, t in found.items():
        if t.state in ("completed", "stopped-early"):
            trim_checkpoints(storage, name, cfg.checkpoint.keep_after_success)
    verdict = promotion.finish_run(storage, best) if best else None
    mutate(storage, cfg.series_name, lambda rec: _close_search(rec, search, verdict))
    return verdict


def _record_trials(
    storage: str, rec: SeriesRecord, search: str, found: dict[str, TrialEntry], best: str | None
) -> None:
    for name, t in found.items():
        e = rec.entry(name)
        if e is not None:
            e.set(
                state=t.state,
                steps=t.step,
                score=e.score if e.score is not None else promotion.score_of(storage, name),
            )
    s = rec.entry(search)
    if s is not None:
        s.winner = best


def _close_search(rec: SeriesRecord, search: str, verdict: Verdict | None) -> None:
    s = rec.entry(search)
    if s is not None and s.ended_at is None:
        s.set(ended_at=time.time(), score=verdict.score if verdict else None, verdict=verdict)


def finish_run(storage: str, run: str) -> Verdict | None:
    """Close a succeeded run in its series: a search through its winner, any other run through the gate itself."""
    reg = registry.load(storage, run)
    if reg is not None and reg.kind == "search":
        return finish_search(storage, run)
    return promotion.finish_run(storage, run)


def final_model(storage: str, run: str) -> str | None:
    """Where a succeeded run's final model is: its own folder, or for a search its winner's (None if neither)."""
    reg = registry.load(storage, run)
    if reg is not None and reg.kind == "search":
        best = winner(trial_states(storage, run))
        run = best or run
    folder = Layout(storage).final_model(run)
    return folder if exists(folder) else None
