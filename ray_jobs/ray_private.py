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
    ("ray.train.v2.torch.torchft_config", "LighthouseServerActor"),
    ("ray._raylet", "Config"),
    ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
    ("ray.train.v2._internal.execution.failure_handling", "FailureDecision"),
    ("ray.train.v2._internal.execution.failure_handling.default", "DefaultFailurePolicy"),
)
# Private attributes read (not imported): (class, attribute path) for the same test.
ATTRIBUTES = (("ray.tune.schedulers.async_hyperband.AsyncHyperBandScheduler", "_brackets[0]._rungs"),)
# Private methods overridden: (class, method) for the same test.
OVERRIDDEN = (
    ("ray.train.v2.api.data_parallel_trainer.DataParallelTrainer", "_create_default_callbacks"),
    ("ray.train.v2.api.data_parallel_trainer.DataParallelTrainer", "_initialize_and_run_controller"),
    ("ray.train.v2.torch.torchft_config._TorchftBackend", "_maybe_create_lighthouse_actor"),
)


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
    subclassed like :func:`torch_backend` to install the SIGTERM handler on every worker, replacements too. Its
    lighthouse actor is created here as Ray creates it -- pinned to the controller's node -- but asking for no CPU:
    Ray's asks for one to be placed (an actor with no resources given does), and the controller's node may have none
    free (a head started with ``num-cpus: 0``, as KubeRay's and the multinode harness's are; a worker node whose one
    CPU trains): the lighthouse would never start, and the run would wait on it forever. Its address is given by
    the node's IP (:func:`by_ip`)."""
    import ray
    from ray.train.v2.torch.torchft_config import LighthouseServerActor, _TorchftBackend
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class Backend(_TorchftBackend):
        def _maybe_create_lighthouse_actor(self, backend_config: Any) -> str:
            if self.lighthouse_actor is None:
                here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
                kwargs = {"bind": "[::]:0"} | backend_config.lighthouse_kwargs  # the OS picks a free port
                self.lighthouse_actor = LighthouseServerActor.options(num_cpus=0, scheduling_strategy=here).remote(
                    lighthouse_kwargs=kwargs
                )
            actor: Any = self.lighthouse_actor  # an actor handle (ty reads the class's own method)
            return by_ip(ray.get(actor.address.remote()))  # read again: it may have been restarted

    return Backend


def by_ip(url: str) -> str:
    """torchft's lighthouse says where it is by this machine's host name, which other nodes may not resolve (a
    Kubernetes pod's; every host of the multinode harness, which share one): the same address by this node's IP,
    as Ray knows it (the lighthouse is pinned to this node)."""
    from urllib.parse import urlsplit, urlunsplit

    import ray

    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{ray.util.get_node_ip_address()}:{parts.port}"))


def asha_rungs(scheduler: Any) -> list[tuple[float, dict[str, float]]]:
    """ASHA's rungs, ``(milestone, {trial id: value})`` (its one bracket's): Tune neither saves nor exposes them,
    and a restored search must decide as the uninterrupted one (ray_jobs/search/scheduler.py)."""
    return scheduler._brackets[0]._rungs


def torch_trainer() -> type[Any]:
    """Ray Train's ``TorchTrainer`` without the actor it starts for Ray Datasets when it is given none: its
    ``DatasetsCallback`` starts a dataset manager (a process importing Ray Data, ~3 CPU-s on a 2-core machine) for
    every worker group -- each in-job restart too -- and unbroken's workers read their shards themselves
    (ray_jobs/data/reading.py). Given datasets, it is Ray's own. Ray has no option for it: the trainer's private
    ``_create_default_callbacks`` builds the list. And its failure policy never retries a user's mistake
    (:func:`no_retry_of_user_errors`): the trainer's private ``_initialize_and_run_controller`` is handed it."""
    # V2's TorchTrainer: what ray.train.torch gives while V2 is on (Ray's default)
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            kwargs["failure_policy"] = no_retry_of_user_errors()(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**kwargs)

    return Trainer


def no_retry_of_user_errors() -> type[Any]:
    """Ray Train's default failure policy, but a worker group that failed on a user's mistake
    (``ray_jobs.errors.UserError``: a reward function that raises, a record a worker cannot read) is not restarted:
    every restart would fail the same way. Ray's policy retries any worker's error up to ``max_failures``."""
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy

    from ray_jobs.errors import user_error

    class NoRetryOfUserErrors(DefaultFailurePolicy):
        def make_decision(self, training_failed_error: Any) -> Any:
            failures = getattr(training_failed_error, "worker_failures", None) or {}
            if any(user_error(e) is not None for e in failures.values()):
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

    return NoRetryOfUserErrors
