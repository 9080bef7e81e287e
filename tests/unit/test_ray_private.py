"""Every private Ray symbol the project relies on is still where ``ray_jobs.ray_private`` imports it from."""

from __future__ import annotations

import importlib

import pytest
import ray

from ray_jobs import ray_private
from ray_jobs.errors import UserError


@pytest.mark.parametrize(("module", "name"), ray_private.SYMBOLS, ids=lambda v: v)
def test_each_private_ray_symbol_is_still_where_it_is_imported_from(module: str, name: str) -> None:
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"Ray {ray.__version__} has no {module}.{name} (used through ray_jobs.ray_private): {e}")
    assert callable(found), f"Ray {ray.__version__}: {module}.{name} is no longer callable"


@pytest.mark.parametrize(("cls", "path"), ray_private.ATTRIBUTES, ids=lambda v: v)
def test_each_private_attribute_read_is_still_there(cls: str, path: str) -> None:
    """A private attribute read off an instance (``asha_rungs``: ASHA's rungs) exists on a fresh one of its class."""
    import re

    module, name = cls.rsplit(".", 1)
    found: object = getattr(importlib.import_module(module), name)(metric="eval_loss", mode="min")
    for attr, index in re.findall(r"\.?(\w+)(?:\[(\d+)\])?", path):
        assert hasattr(found, attr), f"Ray {ray.__version__}: {cls} has no {path} (stops at {attr})"
        found = getattr(found, attr)
        found = found[int(index)] if index else found


def test_the_accessors_return_the_symbols() -> None:
    from ray.train.torch.config import _TorchBackend

    assert ray_private.torch_backend() is _TorchBackend
    assert isinstance(ray_private.auth_headers(), dict)


def test_every_private_ray_import_in_ray_jobs_goes_through_this_module() -> None:
    import re
    from pathlib import Path

    private = re.compile(r"\bray(\.\w+)*\._\w|from ray(\.\w+)* import _\w")  # ray._private..., import _TorchBackend
    root = Path(ray_private.__file__).parent
    strays = [
        str(p.relative_to(root.parent))
        for p in root.rglob("*.py")
        if p.name != "ray_private.py" and private.search(p.read_text())
    ]
    assert not strays, f"private Ray imports outside ray_jobs/ray_private.py: {strays}"


def test_asha_still_keeps_its_rungs_where_a_restored_search_reads_them() -> None:
    from ray.tune.schedulers import AsyncHyperBandScheduler

    asha = AsyncHyperBandScheduler(time_attr="step", metric="eval_loss", mode="min", max_t=400, grace_period=100,
                                   reduction_factor=2, brackets=1)  # fmt: skip
    rungs = ray_private.asha_rungs(asha)
    assert [m for m, _ in rungs] == [400, 200, 100], f"Ray {ray.__version__}: ASHA's rungs moved ({rungs!r})"
    assert all(isinstance(recorded, dict) for _, recorded in rungs)


@pytest.mark.parametrize(("cls", "method"), ray_private.OVERRIDDEN, ids=lambda v: v)
def test_each_private_method_overridden_is_still_there(cls: str, method: str) -> None:
    module, name = cls.rsplit(".", 1)
    found = getattr(getattr(importlib.import_module(module), name), method, None)
    assert callable(found), f"Ray {ray.__version__}: {cls} has no {method} (overridden in ray_jobs.ray_private)"


def test_the_trainer_starts_no_dataset_manager_without_datasets_and_ray_s_own_with_them() -> None:
    """Ray Train's callbacks for a trainer given no Ray Dataset (unbroken's): everything Ray's TorchTrainer would
    start but its ``DatasetsCallback`` (the dataset manager per worker group); given one, the same list as Ray's."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    def kinds(trainer) -> list[str]:
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    ours, rays = ray_private.torch_trainer()(lambda: None), TorchTrainer(lambda: None)
    assert issubclass(ray_private.torch_trainer(), TorchTrainer)
    assert kinds(rays).count(DatasetsCallback.__name__) == 1, f"Ray {ray.__version__} starts Datasets elsewhere"
    assert kinds(ours) == [k for k in kinds(rays) if k != DatasetsCallback.__name__]
    with_data = {"train": ray.data.range(4)}
    assert kinds(ray_private.torch_trainer()(lambda: None, datasets=with_data)) == kinds(
        TorchTrainer(lambda: None, datasets=with_data)
    )


class ColdSource(UserError):
    users_fault = False  # a mistake that may be the environment's (a source not served): retried


@pytest.mark.parametrize(
    ("raised", "decision"),
    [
        (RuntimeError("a worker's own failure"), "RETRY"),
        (ValueError("a bug, not marked the user's"), "RETRY"),
        (UserError("train.rewards: m:f raised ZeroDivisionError at step 6"), "RAISE"),
        (ColdSource("a source not served (maybe the environment's)"), "RETRY"),
    ],
    ids=["runtime", "value", "user", "not-users-fault"],
)
def test_a_worker_group_failing_on_a_users_mistake_is_not_restarted(raised, decision) -> None:
    """Ray Train's policy retries any worker's error up to ``max_failures``; unbroken's raises at once on a user's
    mistake (a restart would fail the same way), and is Ray's own otherwise."""
    from ray.train import FailureConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    policy = ray_private.no_retry_of_user_errors()(FailureConfig(max_failures=2))
    error = WorkerGroupError("rank 1 failed", {0: RuntimeError("peer gone"), 1: raised})
    assert policy.make_decision(error).name == decision
    assert (
        policy.make_decision(WorkerGroupError("again", {0: RuntimeError("x")})).name == "RETRY" or decision == "RAISE"
    )
