"""What watchers outside the search job read of it: each trial's state on storage, and the search's heartbeat.

``runs/<search>/trials.json``: per trial its values, state (``pending`` -> ``running`` -> ``completed`` /
``stopped-early`` / ``failed``), how many times it was started, its newest step and eval loss and the eval loss at
every reported step. Written by a Ray Tune callback on the search's driver at every trial event; a restored
search reads it back and carries on counting (a trial Tune re-runs after the driver was lost is a second start).

``runs/<search>/heartbeat.json``: the watchdog judges a search like any run by its heartbeat. The search's is made
from its trials' own heartbeats (each trial's rank 0 writes one): it trains while any trial trains.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ray.tune import Callback, Stopper

from ray_jobs.config import Config
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.contracts.trials import TrialEntry, Trials
from ray_jobs.search.trials import Trial, read_trials
from ray_jobs.storage import Layout, write_json_atomic
from ray_jobs.train.sidewrite import SideWriter


class TrialProgress(Callback):
    """Tune's trial events -> ``trials.json``. Pickled with the Tuner (a restored search gets it back)."""

    def __init__(self, cfg: Config, trials: list[Trial]) -> None:
        self.storage, self.search, self.max_steps = cfg.storage, cfg.name, cfg.train.max_steps
        self.names = [t.name for t in trials]
        self.fresh = {t.name: TrialEntry(index=t.index, params=t.params) for t in trials}
        self.doc: Trials | None = None

    def setup(
        self,
        stop: Stopper | None = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,
        **info: Any,
    ) -> None:  # Callback.setup's parameters, unused: the trials were named in __init__
        found = read_trials(self.storage, self.search)
        self.doc = found if found and set(found.trials) == set(self.names) else Trials(trials=self.fresh)
        self._save()

    def _trial(self, trial: Any) -> TrialEntry:
        return self._loaded().trials[self.names[trial.config["trial"]]]

    def _loaded(self) -> Trials:
        assert self.doc is not None, "Tune calls setup, which reads or makes the doc, before any trial event"
        return self.doc

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        t = self._trial(trial)
        t.set(starts=t.starts + 1, state="running", error=None)
        self._save()

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        t = self._trial(trial)
        step, loss = int(result.get("step", 0)), result.get("eval_loss")
        t.set(
            step=step, eval_loss=loss, history=[h for h in t.history if h[0] < step] + [(step, loss)]
        )  # a resumed trial re-reports
        self._save()

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        t = self._trial(trial)
        t.state = "completed" if t.step >= self.max_steps else "stopped-early"  # ASHA stopped it before
        self._save()

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        t = self._trial(trial)
        t.set(state="failed", error=_first_line(getattr(trial, "error_msg", None) or "the trial raised"))
        self._save()

    def _save(self) -> None:
        doc = self._loaded()
        doc.updated_at = time.time()
        # every field, set or not: a person reading trials.json sees each pending trial's state and steps too
        write_json_atomic(Layout(self.storage).search_trials(self.search), doc.dump(full=True))


def _first_line(text: str) -> str:
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:500]  # a traceback's last line names the exception


class SearchHeartbeat:
    """``runs/<search>/heartbeat.json`` from the trials' heartbeats of this attempt, every few seconds."""

    def __init__(self, cfg: Config, trials: list[Trial], attempt: int) -> None:
        self.cfg, self.attempt, self.started_at = cfg, attempt, time.time()
        self.urls = [Layout(cfg.storage).heartbeat(t.name) for t in trials]
        self.writer = SideWriter(self.beat, "unbroken-search-heartbeat", every_s=cfg.fault_tolerance.heartbeat_every_s)

    def __enter__(self) -> SearchHeartbeat:
        self.writer.start().poke()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.writer.close(10.0)

    def beat(self) -> None:
        write_json_atomic(Layout(self.cfg.storage).heartbeat(self.cfg.name), self.state(self._beats()).dump())

    def _beats(self) -> list[Beat]:
        beats = []
        for url in self.urls:
            with contextlib.suppress(ValueError):  # torn, or not a heartbeat (RecordError is one): not counted
                b = Beat.read(url)
                if b is not None and b.attempt == self.attempt:
                    beats.append(b)
        return beats

    def state(self, beats: list[Beat]) -> Beat:
        assert self.cfg.tune is not None, "a search's heartbeat starts after its trials, which need a tune section"
        return combine(
            beats,
            self.started_at,
            Beat(
                schema_version=Beat.SCHEMA,
                run=self.cfg.name,
                attempt=self.attempt,
                time=time.time(),
                last_step_at=self.started_at,
                max_steps=self.cfg.train.max_steps * self.cfg.tune.num_trials,
            ),
        )


def combine(beats: list[Beat], started_at: float, search: Beat) -> Beat:
    """The search's heartbeat ``search`` (its run, attempt, time and max_steps) from its trials' ``beats``: training
    while any trial trains (the newest step of any), else the phase of the trial that entered its phase last;
    ``loading`` from the search's start before any trial wrote one."""
    firsts = [b.first_step_at for b in beats if b.first_step_at]
    search.set(
        step=sum(b.step for b in beats),
        started_step=sum(b.started_step for b in beats),
        first_step_at=min(firsts) if firsts else None,
        tokens_per_s=sum(b.tokens_per_s for b in beats if b.phase == "training"),
    )
    training = [b for b in beats if b.phase == "training"]
    if training:
        last = max(b.last_step_at for b in training)
        return search.set(phase="training", phase_started_at=last, last_step_at=last)
    if not beats:
        return search.set(phase="loading", phase_started_at=started_at, last_step_at=started_at)
    newest = max(beats, key=lambda b: b.phase_started_at or 0.0)
    return search.set(
        phase=newest.phase or "loading",
        phase_started_at=newest.phase_started_at,
        last_step_at=max(b.last_step_at for b in beats),
    )
