"""The search's parts that need no cluster: its config checks, its trials, ASHA's rungs across a restore, the
search's heartbeat, the winner, and the CLI's answer to a bad search space."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ray_jobs.config import ConfigError, load_config
from ray_jobs.search.trials import trials
from tests.conftest import ROOT

DEMO_TUNE = ROOT / "configs" / "demo-tune.yaml"


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO_TUNE, list(overrides))
    return e.value.problems


def test_the_demo_search_loads_and_draws_the_same_trials_everywhere() -> None:
    cfg = load_config(DEMO_TUNE)
    a, b = trials(cfg), trials(load_config(DEMO_TUNE))
    assert [t.name for t in a] == [f"demo-tune-t{i:02d}" for i in range(4)]
    assert [t.params for t in a] == [t.params for t in b]  # drawn from tune.seed, not at random
    assert len({t.params["train.lr"] for t in a}) == 4 and all(3e-4 <= t.params["train.lr"] <= 1e-2 for t in a)
    for t in a:  # each trial is a plain run of the search's series with its values set
        assert (
            t.config.tune is None and t.config.series_name == "demo-tune" and t.config.train.lr == t.params["train.lr"]
        )
    assert [t.params for t in trials(load_config(DEMO_TUNE, ["tune.seed=1"]))] != [t.params for t in a]
    assert not cfg.hosted and not any(t.config.hosted for t in a), "its trials run under Ray Tune's driver"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("tune.space.train.nope={choice: [1]}", "tune.space.train.nope: unknown field 'nope' of train"),
        ("tune.space.train.lr={uniform: [0.1, 0.01]}", "tune.space.train.lr: the range [0.1, 0.01] is empty"),
        ("tune.space.train.lr={loguniform: [0, 0.01]}", "tune.space.train.lr: loguniform needs lo > 0"),
        ("tune.space.train.warmup_steps={uniform: [0, 10]}", "tune.space.train.warmup_steps: uniform draws fractions"),
        ("tune.space.train.weight_decay={choice: [0.0, -1]}", "tune.space.train.weight_decay: -1 is not a valid value"),
        ("tune.space.train.lr={normal: [0, 1]}", "tune.space.train.lr: expected one of"),
        ("tune.space.data.seq_len={choice: [32, 64]}", "tune.space.data.seq_len: data fields cannot be searched"),
        ("tune.space.model.lora.r={choice: [4, 8]}", "tune.space.model.lora.r: model.lora is not set"),
        ("tune.space.train.max_steps={choice: [10]}", "tune.space.train.max_steps: cannot be searched"),
        ("tune.space.cluster.num_workers={choice: [1]}", "tune.space.cluster.num_workers: only train.* and model"),
        ("tune.grace_period_steps=700", "tune.grace_period_steps: 700 is above train.max_steps (600)"),
        ("checkpoint.every_steps=150", "checkpoint.every_steps: 150 must be a multiple of train.eval_every_steps"),
        ("tune.max_concurrent_trials=64", "tune.max_concurrent_trials: 64 trials x cluster.num_workers=2"),
        ("tune.num_trials=0", "tune.num_trials: Input should be greater than or equal to 1"),
        ("fault_tolerance.run_host=true", "fault_tolerance.run_host: not for a search yet"),
    ],
)
def test_a_bad_search_is_one_clear_error_naming_the_field(override: str, named: str) -> None:
    found = problems(override)
    assert any(p.startswith(named) for p in found), found


def test_every_bad_field_of_a_search_is_named_at_once() -> None:
    found = problems("tune.space.train.nope={choice: [1]}", "tune.grace_period_steps=700",
                     "tune.space.train.lr={uniform: [1, 0]}")  # fmt: skip
    assert len(found) == 3, found


def test_the_cli_refuses_a_bad_search_before_touching_storage(tmp_path) -> None:
    storage = tmp_path / "storage"
    p = subprocess.run([sys.executable, "-m", "unbroken", "tune", str(DEMO_TUNE), "--set", f"storage={storage}",
                        "--set", "tune.space.train.nope={choice: [1]}"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "tune.space.train.nope: unknown field" in p.stderr and "Traceback" not in p.stderr
    assert not storage.exists()
    p = subprocess.run([sys.executable, "-m", "unbroken", "tune", str(ROOT / "configs" / "demo.yaml"), "--set",
                        f"storage={storage}"], capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "tune: the config has no tune section" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "unbroken", "run", str(DEMO_TUNE), "--set", f"storage={storage}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "run it with `unbroken tune`" in p.stderr, p.stderr
    assert not storage.exists()


class Trial:
    """What ASHA reads of a Tune trial: its id and its config's trial index."""

    def __init__(self, trial_id: str, index: int):
        self.trial_id, self.config = trial_id, {"trial": index}


def test_a_restored_asha_decides_as_the_uninterrupted_one(tmp_path) -> None:
    """Tune restores its scheduler as pickled at the search's start; ours reads its rungs back from storage, by trial
    index (a restored experiment may name trials anew), and stops the trial the uninterrupted search stopped."""
    from ray.tune.schedulers import TrialScheduler

    from ray_jobs.search.scheduler import restorable_asha

    def asha():
        return restorable_asha()(str(tmp_path / "scheduler.json"), time_attr="step", metric="eval_loss", mode="min",
                                 max_t=60, grace_period=20, reduction_factor=2, brackets=1)  # fmt: skip

    first = asha()
    for i, loss in enumerate((1.0, 2.0)):  # two trials reach the rung at step 20
        trial = Trial(f"a_{i}", i)
        first.on_trial_add(None, trial)
        first.on_trial_result(None, trial, {"step": 20, "eval_loss": loss})
    restored = asha()  # the driver was lost; the new one knows the trials under new ids
    for i in range(3):
        restored.on_trial_add(None, Trial(f"b_{i}", i))
    assert restored.on_trial_result(None, Trial("b_2", 2), {"step": 20, "eval_loss": 3.0}) == TrialScheduler.STOP
    fresh = restorable_asha()(str(tmp_path / "none.json"), time_attr="step", metric="eval_loss", mode="min", max_t=60,
                              grace_period=20, reduction_factor=2, brackets=1)  # fmt: skip
    fresh.on_trial_add(None, Trial("c_2", 2))
    assert fresh.on_trial_result(None, Trial("c_2", 2), {"step": 20, "eval_loss": 3.0}) == TrialScheduler.CONTINUE


def test_asha_never_stops_a_trial_at_its_last_step_it_exports_first(tmp_path) -> None:
    """The report at ``max_t`` (the final checkpoint) comes before the trial exports its final model: a stop there
    raced the export (a completed trial with no final model). A worse trial below a rung before max_t is still
    stopped, and the rungs saved for a restore are the same."""
    from ray.tune.schedulers import TrialScheduler

    from ray_jobs.search.scheduler import restorable_asha

    asha = restorable_asha()(str(tmp_path / "scheduler.json"), time_attr="step", metric="eval_loss", mode="min",
                             max_t=40, grace_period=20, reduction_factor=2, brackets=1)  # fmt: skip
    trials = [Trial(f"a_{i}", i) for i in range(3)]
    for t in trials:
        asha.on_trial_add(None, t)
    assert asha.on_trial_result(None, trials[0], {"step": 20, "eval_loss": 1.0}) == TrialScheduler.CONTINUE
    assert asha.on_trial_result(None, trials[1], {"step": 20, "eval_loss": 2.0}) == TrialScheduler.STOP
    for loss, t in ((1.0, trials[0]), (5.0, trials[2])):  # the best, and one far worse at the last rung
        assert asha.on_trial_result(None, t, {"step": 40, "eval_loss": loss}) == TrialScheduler.CONTINUE
    assert json.loads((tmp_path / "scheduler.json").read_text())["rungs"] == {"40": {}, "20": {"0": -1.0, "1": -2.0}}


def test_the_search_heartbeat_trains_while_any_trial_trains() -> None:
    from ray_jobs.contracts.heartbeat import Beat
    from ray_jobs.search.progress import combine

    def trial(**fields: float | str) -> Beat:
        return Beat.model_validate({"run": "s-t00", "attempt": 1, "time": 106.0, "max_steps": 60} | fields)

    def search() -> Beat:
        return Beat(run="s", attempt=1, time=106.0, max_steps=180, last_step_at=10.0)

    loading = trial(step=0, phase="loading", phase_started_at=105.0, last_step_at=100.0)
    done = trial(step=60, phase="done", phase_started_at=90.0, last_step_at=89.0, first_step_at=50.0)
    training = trial(step=30, phase="training", phase_started_at=60.0, last_step_at=99.0, first_step_at=61.0)
    assert combine([], 10.0, search()).phase == "loading"
    both = combine([done, training], 10.0, search())
    assert (both.phase, both.last_step_at, both.step, both.first_step_at) == ("training", 99.0, 90, 50.0)
    between = combine([done, loading], 10.0, search())  # one trial done, the next loading its model: the newest phase
    assert (between.phase, between.phase_started_at) == ("loading", 105.0)
    assert (between.run, between.max_steps) == ("s", 180)


def test_trials_json_follows_tunes_events_and_a_restored_search_carries_on_counting(tmp_path) -> None:
    """The driver's callback writes trials.json through its model at every trial event; a restored search (a new
    driver, the same trials) reads it back: a trial started again counts a second start, a resumed trial's re-reported
    steps replace its history from there, and an error keeps the exception's line."""
    from ray_jobs.search.progress import TrialProgress
    from ray_jobs.search.trials import trial_states

    cfg = load_config(
        DEMO_TUNE, [f"storage={tmp_path}", "tune.num_trials=2", "train.max_steps=40", "tune.grace_period_steps=20"]
    )
    first = TrialProgress(cfg, trials(cfg))
    first.setup()
    names = [t.name for t in trials(cfg)]
    assert [t.state for t in trial_states(cfg.storage, cfg.name).values()] == ["pending", "pending"]
    t0, t1 = Trial("a", 0), Trial("b", 1)
    first.on_trial_start(0, [], t0)
    for step, loss in ((10, 2.0), (20, 1.5)):
        first.on_trial_result(0, [], t0, {"step": step, "eval_loss": loss})
    first.on_trial_start(0, [], t1)
    t1.error_msg = "Traceback (most recent call last):\n  ...\nValueError: bad lr"
    first.on_trial_error(0, [], t1)

    restored = TrialProgress(cfg, trials(cfg))  # the driver was lost: Tune re-runs trial 0 from its checkpoint
    restored.setup()
    restored.on_trial_start(0, [], t0)
    for step, loss in ((20, 1.5), (30, 1.25), (40, 1.0)):
        restored.on_trial_result(0, [], t0, {"step": step, "eval_loss": loss})
    restored.on_trial_complete(0, [], t0)
    found = trial_states(cfg.storage, cfg.name)
    a, b = found[names[0]], found[names[1]]
    assert (a.state, a.starts, a.step, a.eval_loss) == ("completed", 2, 40, 1.0)
    assert a.history == [(10, 2.0), (20, 1.5), (30, 1.25), (40, 1.0)]
    assert (b.state, b.starts, b.error) == ("failed", 1, "ValueError: bad lr")
    assert a.params == trials(cfg)[0].params


def test_the_winner_is_the_completed_trial_with_the_lowest_eval_loss() -> None:
    from control.series import winner
    from ray_jobs.contracts.trials import TrialEntry

    found = {"s-t00": TrialEntry(index=0, params={}, state="completed", eval_loss=0.5),
             "s-t01": TrialEntry(index=1, params={}, state="stopped-early", eval_loss=0.1),
             "s-t02": TrialEntry(index=2, params={}, state="completed", eval_loss=0.4),
             "s-t03": TrialEntry(index=3, params={}, state="failed", eval_loss=None)}  # fmt: skip
    assert winner(found) == "s-t02"
    assert winner({k: v for k, v in found.items() if v.state != "completed"}) is None
