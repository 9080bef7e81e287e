"""MLflow: one MLflow run per run of ours, reopened by every restart, each step's metrics logged once.

The run is found by its tag ``unbroken.run`` (not remembered anywhere: a restart on another node, or after the whole
cluster was lost, finds it the same way) in the experiment ``tracking.mlflow.experiment`` (default: the series).

Exactly once without deleting anything. MLflow has no API to delete metric points, and a restart from the checkpoint
at step ``s`` trains ``s+1..`` again, steps the killed attempt may have logged. So a reopened run first reads which
(metric, step) points it holds, and a point it holds is never logged again: its value is the one a step trained again
gives (bit-identical on CPU) for a loss, a learning rate or a gradient norm, and for a timing (tokens/s, checkpoint
stall) it is the earlier attempt's real measurement of that step. Every point not held is logged, so a reopen also
logs the steps ``1..s`` from the run's metrics log: what a killed process still had queued is added.
``get_metric_history`` then shows each step once. Each point's timestamp is fixed by its step, ``run start_time +
step`` (ms), so the points of two processes racing (an old rank 0 still draining while the new one replays) are the
same (key, timestamp, step, value) -- the primary key of MLflow's SQL metrics table, whose store ignores an exact
repeat -- rather than two. (A step whose loss differs on a rerun, e.g. GPU nondeterminism, keeps its first value:
there is no way to take a point back.) The timestamps lie in the first seconds of the run; plots are by step.

Params (the flattened config) are logged when the run is made; on a reopen only the names it lacks are added (MLflow
refuses to change a logged param). Keys MLflow would reject are left out, values longer than its 6000-character
limit are cut. The final model is a link -- the tag ``unbroken.final_model`` and a ``final_model.txt`` artifact with
its URL -- not a copy of its weights.

Default store: a SQLite file ``<storage>/mlflow.db`` (artifacts under ``<storage>/mlflow-artifacts/<experiment>``) for
local/NFS storage; on an object store ``tracking.mlflow.tracking_uri`` must be set (a config error otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import uuid
from typing import TYPE_CHECKING

from ray_jobs.config import MLflowConfig
from ray_jobs.secrets import CREDENTIALS_ENV, is_masked, mask
from ray_jobs.storage import is_local, join
from ray_jobs.train.tracking.hub import METRICS, RunInfo, kept

if TYPE_CHECKING:
    from mlflow import MlflowClient

RUN_TAG = "unbroken.run"
FINAL_MODEL_TAG = "unbroken.final_model"
MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH
_KEY = re.compile(r"[\w./\- ]{1,250}")  # what MLflow takes as a param name (and 250 chars at most)
_SERVERS = ("http://", "https://", "databricks")  # URIs of a tracking server, which picks its own artifact root


def local_path(url: str) -> str:
    return os.path.abspath(url.removeprefix("file://"))


def tracking_uri(cfg: MLflowConfig, storage: str) -> str:
    """``cfg.tracking_uri``, else the SQLite file under a local storage root. A URI whose credentials did not reach
    this process (still masked: ray_jobs/secrets.py) is refused, saying so, rather than sent to the server."""
    if cfg.tracking_uri and is_masked(cfg.tracking_uri):
        raise ValueError(
            f"tracking.mlflow.tracking_uri {cfg.tracking_uri}: its credentials were not available here "
            f"({CREDENTIALS_ENV} does not hold them), so MLflow is not asked"
        )
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if is_local(storage):
        return "sqlite:///" + os.path.join(local_path(storage), "mlflow.db")
    raise ValueError(
        f"tracking.mlflow.tracking_uri is not set and storage {storage!r} is an object store, where "
        "MLflow's default (a SQLite file under the storage root) cannot live; set it"
    )


def whole_store(uri: str) -> None:
    """Make a SQLite store that does not exist yet whole or not at all. MLflow makes a new SQLite database in place,
    running its schema migrations one by one for seconds; a process killed meanwhile (Ray kills rank 0 with its worker
    group: the chaos test's kill -9 right after the first checkpoint did) leaves a half-migrated file that every later
    client refuses (``table _alembic_tmp_experiments already exists``), and the run's MLflow tracking is gone for
    good. So the database is made under a name of its own beside it and linked into place once complete; a link
    fails where another process's got there first, whose store is then the one."""
    path = uri.removeprefix("sqlite:///")
    if not uri.startswith("sqlite:///") or os.path.exists(path):
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    made = f"{path}.{uuid.uuid4().hex}.making"
    try:
        SqlAlchemyStore("sqlite:///" + made, folder).engine.dispose()  # every table, the default experiment
        try:
            os.link(made, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: a rename, which only another first making can race
            if not os.path.exists(path):
                os.replace(made, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(made)


def artifact_location(uri: str, storage: str, experiment: str) -> str | None:
    """Where a new experiment keeps its artifacts: the server's choice for a tracking server, else under storage
    (MLflow's default would be ``./mlruns`` in whatever the worker's current folder is)."""
    if uri.startswith(_SERVERS):
        return None
    root = local_path(storage) if is_local(storage) else storage
    return join(root, "mlflow-artifacts", experiment)


def client(uri: str) -> MlflowClient:
    """An ``MlflowClient`` on ``uri`` (MLflow's usage telemetry off unless asked for: no calls out of the cluster)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(mc, name: str, location: str | None) -> str:
    """The experiment ``name``'s id, made if missing."""
    from mlflow.exceptions import MlflowException

    found = mc.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mc.create_experiment(name, artifact_location=location)
    except MlflowException:  # made meanwhile by another process
        found = mc.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def find_run(mc, exp_id: str, run: str):
    """The MLflow run of our run ``run`` (the first made, should there be more), or None."""
    escaped = run.replace("'", "\\'")
    found = mc.search_runs(
        [exp_id],
        filter_string=f"tags.\"{RUN_TAG}\" = '{escaped}'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    return found[0] if found else None


def run_tags(info: RunInfo) -> dict[str, str]:
    tags = {
        RUN_TAG: info.run,
        "unbroken.series": info.series,
        "unbroken.dataset": info.dataset_id,
        "unbroken.attempt": str(info.attempt),
    }
    if info.parent:
        tags["unbroken.parent"] = info.parent
    return tags


def params(flat: dict[str, object]) -> dict[str, str]:
    """The config's pairs as MLflow takes them: strings (JSON for non-strings), cut to its length limit; names it
    would reject left out."""
    out = {}
    for key, value in flat.items():
        if not _KEY.fullmatch(key) or posixpath.normpath(key) != key:
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        out[key] = text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."
    return out


class MLflowTracker:
    name = "mlflow"
    mc: MlflowClient  # these two set by ``open``: the hub logs to and closes only a tracker that opened
    run_id: str

    def __init__(self, cfg: MLflowConfig):
        self.cfg = cfg
        self.t0 = 0  # the MLflow run's start time (ms): the timestamp of step 0
        self.held: dict[str, set[int]] = {}  # the steps a reopened run already holds a point at, per metric
        self.links: dict[str, str] = {}

    def open(self, info: RunInfo) -> None:
        from mlflow.entities import Param, RunTag

        uri = tracking_uri(self.cfg, info.storage)
        whole_store(uri)
        self.mc = mc = client(uri)
        experiment = self.cfg.experiment or info.series
        exp_id = experiment_id(mc, experiment, artifact_location(uri, info.storage, experiment))
        run = find_run(mc, exp_id, info.run)
        reopened = run is not None
        if run is None:
            run = mc.create_run(exp_id, run_name=info.run, tags=run_tags(info))
        else:  # a restart: the same run, running again, its attempt updated
            mc.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in run_tags(info).items()])
            mc.update_run(run.info.run_id, status="RUNNING")
        self.run_id, self.t0 = run.info.run_id, run.info.start_time
        self.held = held(mc, self.run_id) if reopened else {}
        self.links = run_links(uri, experiment, exp_id, self.run_id)
        new = [Param(k, v) for k, v in params(info.params).items() if k not in run.data.params]
        for i in range(0, len(new), PER_BATCH):
            mc.log_batch(self.run_id, params=new[i : i + PER_BATCH])
        self._replay(kept(info))

    def _replay(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """The steps up to the resumed one again: the points the killed process still had queued are added."""
        points = [p for step, metrics in steps for p in self._new(step, metrics)]
        for i in range(0, len(points), METRICS_PER_BATCH):
            self.mc.log_batch(self.run_id, metrics=points[i : i + METRICS_PER_BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if points := self._new(step, metrics):
            self.mc.log_batch(self.run_id, metrics=points)

    def _new(self, step: int, metrics: dict[str, float]) -> list:
        """The points of ``step`` this run does not hold yet."""
        from mlflow.entities import Metric

        return [Metric(k, v, self.t0 + step, step) for k, v in metrics.items() if step not in self.held.get(k, ())]

    def close(self, status: str, final_model: str | None) -> None:
        if final_model:
            self.mc.set_tag(self.run_id, FINAL_MODEL_TAG, final_model)
            self.mc.log_text(self.run_id, final_model + "\n", "final_model.txt")
        self.mc.set_terminated(self.run_id, status)


def run_links(uri: str, experiment: str, exp_id: str, run_id: str) -> dict[str, str]:
    """Where a person finds the run: its page on a tracking server, else the UI to start on the store."""
    uri = mask(uri)  # what a person is shown (tracking.json, the flow's artifact), never the credentials
    links = {"tracking_uri": uri, "experiment": experiment, "run_id": run_id}
    if uri.startswith(("http://", "https://")):
        return links | {"url": f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"}
    return links | {"view": f"mlflow ui --backend-store-uri {uri}"}


def held(mc, run_id: str) -> dict[str, set[int]]:
    """The steps at which the MLflow run holds a point, per metric the trackers log."""
    return {key: {m.step for m in mc.get_metric_history(run_id, key)} for key in METRICS.values()}


def end_run(cfg: MLflowConfig, info: RunInfo, status: str) -> bool:
    """End our run's MLflow run as ``status`` if it is still RUNNING (its job died before closing it); whether it
    was. Nothing is made: no experiment or run means nothing to end."""
    mc = client(tracking_uri(cfg, info.storage))
    found = mc.get_experiment_by_name(cfg.experiment or info.series)
    run = find_run(mc, found.experiment_id, info.run) if found is not None else None
    if run is None or run.info.status != "RUNNING":
        return False
    mc.set_terminated(run.info.run_id, status)
    return True


TRACKER = MLflowTracker  # what tracking.mlflow switches on (ray_jobs/train/tracking/__init__.py)
