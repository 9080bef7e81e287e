"""Every private Ray symbol the project uses, in one place: a Ray upgrade that moves one breaks here, and
``tests/unit/test_ray_private.py`` names it.

Each is imported lazily, inside the function that needs it: importing ``ray_jobs`` must stay fast and must not
import Ray (flows load ``ray_jobs.config`` without it).
"""

from __future__ import annotations

from typing import Any

# (module, name) of each private symbol, for the test that checks a Ray upgrade kept them.
SYMBOLS = (
    ("ray._private.authentication.http_token_authentication", "get_auth_headers_if_auth_enabled"),
    ("ray.train.torch.config", "_TorchBackend"),
    ("ray.train.v2.torch.torchft_config", "_TorchftBackend"),
    ("ray._raylet", "Config"),
    ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
)
# Private attributes read (not imported): (class, attribute path) for the same test.
ATTRIBUTES = (("ray.tune.schedulers.async_hyperband.AsyncHyperBandScheduler", "_brackets[0]._rungs"),)
# Private methods overridden: (class, method) for the same test.
OVERRIDDEN = (("ray.train.v2.api.data_parallel_trainer.DataParallelTrainer", "_create_default_callbacks"),)


def auth_headers() -> dict[str, str]:
    """The HTTP headers that authenticate this machine's Ray client to a Jobs API with token auth (empty when auth
    is off): Ray has no public call for them."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    return get_auth_headers_if_auth_enabled({})


def reload_ray_config() -> None:
    """Make Ray's C++ config read its environment again (``RAY_AUTH_MODE`` set after Ray was imported): Ray has no
    public call for it."""
    # ray/_raylet.pyi lists only the ID classes, not the Cython ``Config`` the compiled module has
    from ray._raylet import Config  # ty: ignore[import-not-found]

    Config.initialize("")


def torch_backend() -> type[Any]:
    """Ray Train's torch backend class, subclassed to run code on every worker when the group starts (Ray has no
    public hook for it)."""
    from ray.train.torch.config import _TorchBackend

    return _TorchBackend


def torchft_backend() -> type[Any]:
    """Ray Train's torchft backend (``TorchftConfig``'s: a lighthouse, a process group per replica group),
    subclassed like :func:`torch_backend` to install the SIGTERM handler on every worker, replacements too."""
    from ray.train.v2.torch.torchft_config import _TorchftBackend

    return _TorchftBackend


def asha_rungs(scheduler: Any) -> list[tuple[float, dict[str, float]]]:
    """ASHA's rungs, ``(milestone, {trial id: value})`` (its one bracket's): Tune neither saves nor exposes them,
    and a restored search must decide as the uninterrupted one (ray_jobs/search/scheduler.py)."""
    return scheduler._brackets[0]._rungs


def torch_trainer() -> type[Any]:
    """Ray Train's ``TorchTrainer`` without the actor it starts for Ray Datasets when it is given none: its
    ``DatasetsCallback`` starts a dataset manager (a process importing Ray Data, ~3 CPU-s on a 2-core machine) for
    every worker group -- each in-job restart too -- and unbroken's workers read their shards themselves
    (ray_jobs/data/reading.py). Given datasets, it is Ray's own. Ray has no option for it: the trainer's private
    ``_create_default_callbacks`` builds the list."""
    # V2's TorchTrainer: what ray.train.torch gives while V2 is on (Ray's default)
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    return Trainer
