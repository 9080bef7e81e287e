"""The training engines as one table (ray_jobs/config/engines.py) and one protocol (ray_jobs/train/engine.py): the
choices of ``train.engine`` are the table's, every row's trainer is the native Trainer or a subclass overriding only
its public hooks, nothing outside the config compares an engine's name, and a new row is refused by its
capabilities alone."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import get_args

import pytest

from ray_jobs.config import Config, load_config
from ray_jobs.config.engine import REFUSALS, asked, capability_problems
from ray_jobs.config.engines import ENGINES, Engine, EngineName, engine_of, needs
from ray_jobs.train.engine import EngineHooks
from ray_jobs.train.trainer import Trainer
from ray_jobs.train.worker import trainer_class
from tests.conftest import ROOT

DEMO = ROOT / "configs" / "demo.yaml"
HOOKS = [n for n, v in vars(EngineHooks).items() if not n.startswith("_") and callable(getattr(v, "__func__", v))]


def test_train_engine_offers_the_rows_without_a_switch() -> None:
    assert list(get_args(EngineName)) == [n for n, e in ENGINES.items() if e.switch is None]
    assert all(name == e.name for name, e in ENGINES.items())


@pytest.mark.parametrize("name", list(ENGINES))
def test_each_rows_trainer_is_the_native_one_or_overrides_only_its_public_hooks(name: str) -> None:
    cls = trainer_class(ENGINES[name])
    assert issubclass(cls, Trainer), cls
    private = {n for n in vars(Trainer) if n.startswith("_") and not n.startswith("__")}
    overridden = sorted(private & set(vars(cls))) if cls is not Trainer else []
    assert overridden == [], f"{cls.__name__} overrides private methods of Trainer: {overridden}"
    assert inspect.ismethod(cls.for_worker)  # how the worker builds it, whatever its constructor takes


def test_the_native_trainer_implements_every_hook_of_the_protocol() -> None:
    assert len(HOOKS) > 10, HOOKS
    for hook in HOOKS:
        assert callable(getattr(Trainer, hook, None)), hook
        mine, theirs = inspect.signature(getattr(Trainer, hook)), inspect.signature(getattr(EngineHooks, hook))
        assert list(mine.parameters) == list(theirs.parameters), (hook, mine, theirs)


def test_no_module_outside_the_config_compares_an_engines_name() -> None:
    """Capabilities are read from the rows (``engine_of(cfg).fsdp``), never ``cfg.train.engine == "hf"``."""
    found = []
    for folder in ("ray_jobs", "control", "flows", "tasks", "unbroken"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent == ROOT / "ray_jobs" / "config":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
                if any(isinstance(s, ast.Attribute) and s.attr == "engine" for s in sides):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], found


def test_the_engine_that_runs_a_config_is_its_switchs_or_train_engines() -> None:
    assert engine_of(load_config(DEMO)).name == "native"
    assert engine_of(load_config(DEMO, ["train.engine=hf"])).name == "hf"
    live = load_config(DEMO, ["fault_tolerance.live_recovery=true", "cluster.num_workers=2"])
    assert engine_of(live).name == "live" and live.workers == (2, 2)
    standby = load_config(
        DEMO, ["fault_tolerance.live_recovery=true", "cluster.num_workers=2", "fault_tolerance.standby_replicas=1"]
    )
    assert standby.workers == (3, 3)  # the live row takes standbys: they are workers too


def test_every_capability_a_config_asks_for_has_a_field_and_a_refusal() -> None:
    capabilities = {f.name for f in dataclasses.fields(Engine) if f.type == "bool"}
    assert set(asked(load_config(DEMO))) | {"live_recovery", "local_mode"} <= capabilities & set(REFUSALS)
    assert needs("preference") == "train.engine=hf" and needs("fsdp") == "train.engine=native or train.engine=hf"
    assert needs("standbys") == "fault_tolerance.live_recovery=true"


def _as_engine(cfg: Config, name: str) -> Config:
    """``cfg`` with ``train.engine`` set to a row the literal does not hold yet (no validation)."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"engine": name})})


def test_a_new_row_is_refused_by_its_capabilities_alone(monkeypatch) -> None:
    toy = Engine("toy", "tests.unit.test_engines:Trainer", "a toy: the native loop by another name", lora=False)
    monkeypatch.setitem(ENGINES, "toy", toy)
    lora = load_config(DEMO, ["model.lora.r=4", "train.parallelism=ddp"])
    assert capability_problems(_as_engine(lora, "toy")) == [
        "model.lora: train.engine=toy trains no LoRA adapters (they need train.engine=native or train.engine=hf)"
    ]
    fsdp = _as_engine(load_config(DEMO, ["train.parallelism=fsdp"]), "toy")
    assert capability_problems(fsdp) == [
        "train.engine: toy runs DDP only (train.parallelism=fsdp needs train.engine=native or train.engine=hf)"
    ]
    live = _as_engine(load_config(DEMO, ["fault_tolerance.live_recovery=true", "cluster.num_workers=2"]), "toy")
    assert capability_problems(live) == [
        "train.engine: toy cannot run fault_tolerance.live_recovery (its replicas run the steps of train.engine=native)"
    ]
    assert trainer_class(toy) is Trainer
