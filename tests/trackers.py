"""What a run's experiment trackers hold, read with their own readers (TensorBoard's event accumulator, an MLflow
client on the run's SQLite store), and the check the end-to-end and chaos tests make of it: one run per tracker,
each logged step once, and every point equal to the run's metrics log -- or to an uninterrupted run's, which a
resumed run's training matches bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ray_jobs.storage import Layout
from ray_jobs.train.metrics import read_rows
from ray_jobs.train.tracking.hub import METRICS

# The columns whose values a rerun reproduces; timings (tokens/s, checkpoint stalls) are each attempt's own.
DETERMINISTIC = ("loss", "eval_loss", "lr", "grad_norm")
TRACKING = {"tracking.tensorboard": "true", "tracking.mlflow": "true"}  # both on, their defaults


def tensorboard_points(event_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows them: purges applied, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def mlflow_run(storage: str | Path, experiment: str, run: str):
    """(MlflowClient, the one MLflow run of ``run`` in ``experiment``) on the default store under ``storage``."""
    from ray_jobs.config import MLflowConfig
    from ray_jobs.train.tracking.mlflow import RUN_TAG, client, tracking_uri

    mc = client(tracking_uri(MLflowConfig(), str(storage)))
    exp = mc.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment}"
    found = mc.search_runs([exp.experiment_id], filter_string=f"tags.\"{RUN_TAG}\" = '{run}'")
    assert len(found) == 1, f"{len(found)} MLflow runs of {run}: one expected"
    return mc, found[0]


def logged(storage: str | Path, run: str) -> dict[str, dict[int, float]]:
    """Each tracked column of the run's metrics log: step -> value."""
    rows = read_rows(Layout(str(storage)).metrics(run))
    return {k: {r["step"]: float(r[k]) for r in rows if isinstance(r.get(k), int | float)} for k in METRICS}


def check_trackers(storage: str | Path, run: str, series: str, expected: dict[str, dict[int, float]] | None = None,
                   status: str = "FINISHED") -> None:  # fmt: skip
    """TensorBoard and MLflow each hold run ``run`` once with every logged step once; the deterministic columns'
    values are ``expected``'s (default: the run's own metrics log), every column's steps are the metrics log's."""
    own = logged(storage, run)
    want = expected or own
    mc, found = mlflow_run(storage, series, run)
    assert found.info.status == status, found.info.status
    assert found.data.params["name"] == run and found.data.tags["unbroken.final_model"], found.data
    event_dir = Path(Layout(str(storage)).run_dir(run).removeprefix("file://")) / "tensorboard"
    for column, tag in METRICS.items():
        tb = tensorboard_points(event_dir, tag)
        ml = [(m.step, m.value) for m in mc.get_metric_history(found.info.run_id, tag)]
        for tracker, points in (("tensorboard", tb), ("mlflow", ml)):
            steps = [s for s, _ in points]
            assert steps == sorted(set(steps)) == sorted(own[column]), f"{tracker} {tag}: steps {steps}"
            if column in DETERMINISTIC:
                values = np.array([v for _, v in points])
                exact = np.array([want[column][s] for s in steps])
                if tracker == "tensorboard":  # its event files hold float32
                    exact = exact.astype(np.float32).astype(np.float64)
                assert np.array_equal(values, exact), f"{tracker} {tag}: {points} != {want[column]}"


def screenshot_tensorboard(logdir: str | Path, shot: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    """TensorBoard's own server and UI on ``logdir``: the UI's scalars page rendered by headless Chromium into
    ``shot`` (kept for people to look at; docs/tracking.md's picture), and the (step, value) points of ``tag`` the server
    gives that page."""
    import json
    import shutil
    import subprocess
    import sys
    import urllib.parse
    import urllib.request

    from tests.procs import free_port, wait_for

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Chromium is needed to render TensorBoard (Debian package `chromium`: `make browser`)"
    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
                              "--host", "127.0.0.1", "--reload_interval", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for("TensorBoard", lambda: _answers(url + "data/runs"), 120, 0.5)
        shot.parent.mkdir(parents=True, exist_ok=True)
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--window-size=1400,1000", "--virtual-time-budget=20000", f"--screenshot={shot}"]  # fmt: skip
        subprocess.run([*flags, url + "#scalars&tagFilter=loss&_smoothingWeight=0"], capture_output=True, timeout=120,
                       check=True)  # fmt: skip
        assert shot.exists() and shot.stat().st_size > 10_000, f"a real screenshot of {url}"
        query = urllib.parse.urlencode({"run": ".", "tag": tag})
        served = json.loads(urllib.request.urlopen(f"{url}data/plugin/scalars/scalars?{query}", timeout=30).read())
        return [(step, value) for _, step, value in served]
    finally:
        board.terminate()
        board.wait(timeout=30)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False
