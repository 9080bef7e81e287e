"""The served deployments (``unbroken serve``): finetune, tune, stage-dataset, watchdog and the dataset sensor.

``build()`` is the single definition of what is served; ``prefect.yaml`` declares the same set for teams that deploy
to a process work pool, and a test keeps the two in agreement.

- ``finetune``: a cron schedule (optional), and a trigger on ``unbroken.dataset.updated`` whose payload's
  ``dataset_uri`` becomes the run's ``data.train``. Runs are named ``<name>-{dataset}`` (see ``serve_name``). One
  active run per series is enforced inside the flow (a global concurrency limit named after the series), because
  a deployment-level limit cannot see series.
- ``tune``: a hyperparameter search (``unbroken tune``) of the tune config, on demand (the UI's Run button, with
  other overrides as parameters).
- ``stage-dataset``: on demand.
- ``watchdog``: an interval schedule, and a trigger on any ``finetune`` or ``tune`` flow run that ends FAILED
  (including TimedOut) or CRASHED: the hand-over from the flow is immediate.
- ``dataset-sensor``: an interval schedule; fingerprints the source location and emits the event above on change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.events import DeploymentEventTrigger

from flows.finetune import finetune
from flows.sensor import EVENT, dataset_sensor
from flows.stage import stage_flow
from flows.tune import tune
from flows.watchdog import watchdog
from ray_jobs.secrets import export_credentials


@dataclass
class ServeOptions:
    config: str = "configs/demo.yaml"
    storage: str = ".unbroken/storage"
    cron: str | None = None  # finetune schedule, e.g. "0 3 * * *"; None = on demand and by trigger only
    watchdog_interval_s: float = 60.0
    sensor_source: str | None = None  # where new data lands (defaults to the config's data.train)
    sensor_interval_s: float = 60.0
    tune_config: str = "configs/demo-tune.yaml"  # the config the tune deployment searches over


def serve_name(name: str) -> list[str]:
    """Served retraining names each run by its data: a fixed ``name`` becomes ``<name>-{dataset}`` in series
    ``<name>``, so every new dataset (an event, a cron tick after new data landed) is a new run of one lineage and
    the same dataset again is the run that already trained it. A config that has a template keeps it."""
    if "{" in name:
        return []
    return [f"name={name}-{{dataset}}", f"series.name={name}"]


def dataset_trigger(config: str) -> DeploymentEventTrigger:
    return DeploymentEventTrigger(
        name="retrain-on-dataset-update",
        expect={EVENT},
        match={"prefect.resource.id": "unbroken.dataset.*"},
        parameters={"config_path": config, "dataset_uri": "{{ event.payload.dataset_uri }}"},
    )


def finetune_failed_trigger(storage: str) -> DeploymentEventTrigger:
    # Match the state *type*: a run that times out ends FAILED with the state name TimedOut.
    return DeploymentEventTrigger(
        name="recover-failed-finetune",
        expect={"prefect.flow-run.*"},
        match={"prefect.resource.id": "prefect.flow-run.*", "prefect.state-type": ["FAILED", "CRASHED"]},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": ["finetune", "tune"]},
        parameters={"storage": storage},
    )


def _checked(opts: ServeOptions) -> tuple[str, str, str, list[str]]:
    """(config URL, storage URL, sensor source, the served finetune's overrides), every one checked before anything
    is served: the sensor's source must be one the finetune flow accepts, and a served name too long for its
    ``{dataset}`` suffix fails here, not at the first event."""
    from control.config import load_config
    from control.sources import check_allowed_source
    from ray_jobs.config import ConfigError, absolute_url

    config = str(absolute_url(opts.config))
    storage = str(absolute_url(opts.storage))
    cfg = load_config(config, [f"storage={storage}"])
    source = opts.sensor_source or cfg.data.train
    if not isinstance(source, str):  # a list of sources (or a hub dataset) is no one location to watch
        says = f"data.train names {len(source)} source(s), not one location: name the one the sensor watches"
        raise ConfigError([f"{says} with --watch-source"])
    check_allowed_source(cfg, str(absolute_url(source)))  # what the sensor announces, the finetune flow must accept
    retrain = [f"storage={storage}", *serve_name(cfg.name)]
    load_config(config, retrain)
    # The sensor's source becomes a flow run parameter, which Prefect stores and shows: masked, its credentials kept
    # in this process's UNBROKEN_CREDENTIALS, which the flow runs it serves inherit (flows/sensor.py reveals it).
    return config, storage, export_credentials([str(absolute_url(source))])[0], retrain


def _tune_config(opts: ServeOptions, storage: str) -> str:
    """The tune deployment's config, checked before anything is served (a search space error fails here)."""
    from control.config import load_config
    from ray_jobs.config import absolute_url

    config = str(absolute_url(opts.tune_config))
    load_config(config, [f"storage={storage}"])
    return config


def build(opts: ServeOptions) -> list[Any]:
    """The RunnerDeployments ``unbroken serve`` serves."""
    config, storage, source, retrain = _checked(opts)
    return [
        finetune.to_deployment(
            "finetune",
            cron=opts.cron,
            parameters={"config_path": config, "overrides": retrain},
            triggers=[dataset_trigger(config)],
            description="fine-tune from a config; retrains when the dataset sensor sees new data",
            tags=["unbroken"],
        ),
        tune.to_deployment(
            "tune",
            parameters={"config_path": _tune_config(opts, storage), "overrides": [f"storage={storage}"]},
            description="a hyperparameter search (Ray Tune) over the config's tune.space; the winner is gated",
            tags=["unbroken"],
        ),
        stage_flow.to_deployment(
            "stage-dataset",
            parameters={"config_path": config, "overrides": [f"storage={storage}"]},
            tags=["unbroken"],
        ),
        watchdog.to_deployment(
            "watchdog",
            interval=opts.watchdog_interval_s,
            parameters={"storage": storage},
            triggers=[finetune_failed_trigger(storage)],
            description="restart failed, hung and cluster-less runs from their newest valid checkpoint",
            tags=["unbroken"],
        ),
        dataset_sensor.to_deployment(
            "dataset-sensor",
            interval=opts.sensor_interval_s,
            parameters={"source": source, "storage": storage},
            description=f"emit {EVENT} when the source's files change",
            tags=["unbroken"],
        ),
    ]


def serve(opts: ServeOptions) -> None:
    """Register the deployments with the Prefect server at ``PREFECT_API_URL`` and run their flow runs here."""
    from prefect import serve as prefect_serve

    from deployments.cancels import install

    install()  # a cancel is carried out however long the Prefect server was away
    prefect_serve(*build(opts), limit=4)
