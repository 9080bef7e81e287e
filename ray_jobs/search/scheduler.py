"""The search's trial scheduler: Ray Tune's own ASHA (or FIFO), with rungs that survive a restored experiment.

Tune saves its search algorithm's state with the experiment, not its scheduler's (``TuneController.save_to_dir``),
and ``Tuner.restore`` unpickles the scheduler as it was when the search began. A restored ASHA would start with
empty rungs and let a trial through that the uninterrupted search stopped. So the rungs are written to storage
(``runs/<search>/scheduler.json``, by trial index: a restored or restarted experiment may give trials new ids)
whenever they change, and read back when a restored scheduler first sees its trials.

A trial is never stopped at ``max_t``: its report at ``train.max_steps`` (its final checkpoint) comes before it
exports its final model and scores it. ASHA stops every trial there (and may by the rung at ``max_t``): Tune then
killed the trial mid-export -- a "completed" trial with no final model, a winner the gate cannot score. It has no
step left to train, so no decision changes: it ends by itself once exported.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ray_jobs.config import Config
from ray_jobs.storage import Layout, read_json, write_json_atomic


def make_scheduler(cfg: Config) -> Any:
    from ray.tune.schedulers import FIFOScheduler

    t = cfg.tune
    assert t is not None, "a search's scheduler is made after its trials, which refuse a config with no tune section"
    if t.scheduler == "fifo":
        return FIFOScheduler()
    return restorable_asha()(
        Layout(cfg.storage).search_scheduler(cfg.name),
        time_attr="step",
        max_t=cfg.train.max_steps,
        grace_period=t.grace_period_steps,
        reduction_factor=t.reduction_factor,
        brackets=1,  # one bracket: which trial goes where is not drawn at random, so decisions repeat
    )


def restorable_asha() -> type:
    """The class, made when Ray is imported (``ray_jobs`` imports without Ray)."""
    from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

    from ray_jobs.ray_private import asha_rungs

    class RestorableASHA(AsyncHyperBandScheduler):
        def __init__(self, url: str, **kw: Any) -> None:
            super().__init__(**kw)
            self.url = url
            self.saved: dict[str, dict[str, float]] | None = None  # milestone -> trial index -> value, once read
            self.index_of: dict[str, int] = {}  # trial id -> trial index

        def on_trial_add(self, tune_controller: Any, trial: Any) -> None:  # the base class's names: keywords work
            super().on_trial_add(tune_controller, trial)
            if self.saved is None:
                self.saved = _read(self.url)
            index = trial.config["trial"]
            self.index_of[trial.trial_id] = index
            for milestone, recorded in asha_rungs(self):
                value = self.saved.get(str(milestone), {}).get(str(index))
                if value is not None:
                    recorded[trial.trial_id] = value

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            action = super().on_trial_result(tune_controller, trial, result)
            self._save()
            return TrialScheduler.CONTINUE if result.get(self._time_attr, 0) >= self._max_t else action

        def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
            super().on_trial_complete(tune_controller, trial, result)
            self._save()

        def _save(self) -> None:
            rungs = by_index(asha_rungs(self), self.index_of)
            if rungs != self.saved:
                write_json_atomic(self.url, {"rungs": rungs})
                self.saved = rungs

    return RestorableASHA


def by_index(rungs: list[tuple[float, dict[str, float]]], index_of: dict[str, int]) -> dict[str, dict[str, float]]:
    """ASHA's rungs keyed by milestone and trial index (what is saved)."""
    return {str(m): {str(index_of[t]): v for t, v in rec.items() if t in index_of} for m, rec in rungs}


def _read(url: str) -> dict[str, dict[str, float]]:
    with contextlib.suppress(FileNotFoundError):
        return read_json(url)["rungs"]
    return {}
