"""The GRPO demo as ``make demo-grpo`` runs it, cut short: ``unbroken run configs/demo-grpo-sft.yaml`` (a short SFT
of the built-in model on a local Ray head), then ``unbroken run configs/demo-grpo.yaml`` from its export -- the
flow stages the prompts one a row, ships the reward module with the job, and the run ends succeeded with each
reward logged, the summary answering held-out prompts before and after."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import read_metrics, read_registry, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.full(shard=2)]
PORTS = {"cluster.dashboard_port": 8296, "cluster.head_port": 6411}  # this module's own head


def sets(**kv: object) -> list[str]:
    return [arg for k, v in (kv | PORTS).items() for arg in ("--set", f"{k}={v}")]


def test_the_grpo_demo_runs_both_stages_through_unbroken_run(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    own = {"storage": storage, "data.cache_dir": tmp_path / "cache", "data.work_dir": tmp_path / "work"}
    sft = run_cli("run", str(ROOT / "configs" / "demo-grpo-sft.yaml"), *sets(**own, **{"train.max_steps": 100}))
    assert sft.returncode == 0, sft.explain()
    model = storage / "runs" / "demo-grpo-sft" / "final"
    grpo = run_cli("run", str(ROOT / "configs" / "demo-grpo.yaml"), *sets(**own, **{
        "model.name_or_path": model, "train.max_steps": 20, "train.log_every_steps": 5, "train.eval_every_steps": 10,
        "checkpoint.every_steps": 10, "train.sample_generations": 8}))  # fmt: skip
    assert grpo.returncode == 0, grpo.explain()
    assert read_registry(storage, "demo-grpo")["state"] == "succeeded"
    rows = [m for m in read_metrics(storage, "demo-grpo") if "reward" in m]
    assert [m["step"] for m in rows] == [5, 10, 15, 20]
    assert all({"reward_correct", "reward_digits_right", "completion_length"} <= set(m) for m in rows), rows
    assert "before:" in grpo.stdout and "after:" in grpo.stdout, grpo.stdout[-3000:]


def test_a_reward_function_that_raises_fails_the_run_once_as_the_users_mistake(tmp_path: Path) -> None:
    """A reward that raises at step 6, after the checkpoint at 4: the job fails once (Ray Train does not restart the
    group on a user's mistake), ``unbroken run`` says the mistake in one line and exits 2, the run ends failed with
    it as the reason -- no restart, no incident left for a watchdog -- and the checkpoint stays."""
    from ray_jobs import checkpoint as ckpt
    from ray_jobs.storage import Layout

    storage = tmp_path / "storage"
    r = run_cli("run", str(ROOT / "configs" / "demo-grpo.yaml"), *sets(**{
        "storage": storage, "data.cache_dir": tmp_path / "cache", "data.work_dir": tmp_path / "work",
        "name": "raises", "model.name_or_path": "builtin:tiny-llama", "train.max_steps": 30,
        "checkpoint.every_steps": 4, "train.rewards": "[{function: 'tests.unit.grpo_rewards:raises'}]"}))  # fmt: skip
    assert r.returncode == 2, r.explain()
    said = "error: train.rewards: tests.unit.grpo_rewards:raises raised ZeroDivisionError: division by zero at step 6"
    last = (r.stderr.strip().splitlines() or [""])[-1]  # (the job's log is forwarded above it: not a terminal)
    assert last.startswith(said) and last.count("train.rewards") == 1, r.explain()
    reg = read_registry(storage, "raises")
    assert (reg["state"], len(reg["attempts"]), reg.get("incidents", [])) == ("failed", 1, []), reg
    assert reg["reason"].startswith(said.removeprefix("error: "))
    kept = ckpt.find_latest_valid(Layout(str(storage)).checkpoints_dir("raises"))
    assert kept is not None and kept[0].endswith("checkpoint-step-00000004")
