"""Ray Jobs entrypoint for training: ``python -m ray_jobs.job --spec <url of job spec json>``.

The job spec (written by the flow's submit task) holds the validated config, the dataset manifest URL, the base
model folder and optionally an explicit checkpoint to resume from. The same ``RunConfig(name, storage_path)`` on
every attempt lets Ray Train V2 pick up its own checkpoint bookkeeping when a job is resubmitted.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ray_jobs.config import Config, job_spec
from ray_jobs.config.engines import engine_of
from ray_jobs.contracts.dataset import DatasetManifest, read_manifest
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.job_spec import AttemptInputs, JobSpec, WorkerSpec
from ray_jobs.errors import user_error
from ray_jobs.secrets import mask, mask_output
from ray_jobs.storage import Layout, fs_and_path, join, pyarrow_filesystem, read_bytes, strip_protocol

if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.config import ScalingConfig

log = logging.getLogger("unbroken.job")

# How often Ray Train's controller polls its workers (Ray's default 2 s): a worker group that finished, or reported a
# checkpoint, is noticed within this. Each poll is one small actor call per worker; at 2 s the end of every job waited
# ~4 s for two polls. Propagated by Ray Train from this driver to its controller and workers; a value set by the user
# (or a cluster's environment) wins.
POLL_INTERVAL_ENV, POLL_INTERVAL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25"


def worker_config(cfg: Config, manifest: DatasetManifest, inputs: AttemptInputs) -> WorkerSpec:
    """What every rank is given to train ``cfg`` on the staged ``manifest`` (``inputs.manifest_url``'s) from
    ``inputs.model_path`` (a fresh start, or the newest valid checkpoint): local mode's, and the benchmarks'."""
    return WorkerSpec(config=cfg.model_dump_json(), inputs=inputs, manifest=manifest)


def loop_config(spec: JobSpec, cfg: Config) -> WorkerSpec:
    """What every rank is given, from a job spec: the manifests are read once, here, not by every rank."""
    inputs = spec.inputs
    score = read_manifest(inputs.score_manifest_url) if inputs.score_manifest_url else None
    return worker_config(cfg, read_manifest(inputs.manifest_url), inputs).set(
        resume_from=spec.resume_from, attempt=spec.attempt, score_manifest=score
    )


def build_trainer(cfg: Config, loop: WorkerSpec, callbacks: list | None = None) -> TorchTrainer:
    """Ray Train's TorchTrainer for this run: every worker runs ``train_loop_per_worker(loop)``. ``callbacks``: Ray
    Train callbacks (a search's trial passes Tune's, which forwards rank 0's reports to the scheduler)."""
    # Ray Train V2's own classes (what ``ray.train`` re-exports while V2 is on, Ray's default; ``ray.train.torch``'s
    # TorchTrainer is V2's and takes only these): ``max_preemption_failures`` is V2's alone
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig

    from ray_jobs.ray_private import torch_trainer
    from ray_jobs.train.heartbeat import group_restarts
    from ray_jobs.train.preemption import torch_config
    from ray_jobs.train.worker import train_loop_per_worker

    storage = Layout(cfg.storage).ray_storage()
    set_aside_torn_snapshot(join(storage, cfg.name))
    fs = pyarrow_filesystem(storage)
    return torch_trainer()(
        train_loop_per_worker,
        # Ray Train keeps the loop config in its run's state (the dashboard's Train page shows it): the config masked,
        # revealed by each worker from the job's environment (``train.worker.run_worker``: ``from_json``)
        train_loop_config=loop.model_dump(mode="json") | {"config": mask(loop.config, ())},
        torch_config=torch_config(cfg.cluster.use_gpu, cfg.fault_tolerance.preemption_grace_s, lighthouse(cfg)),
        scaling_config=scaling_config(cfg),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=strip_protocol(storage) if fs is not None else storage,
            storage_filesystem=fs,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.checkpoint.num_to_keep,
                checkpoint_score_attribute=cfg.checkpoint.keep_best_by,
                checkpoint_score_order="min",
            ),
            failure_config=FailureConfig(
                max_failures=cfg.fault_tolerance.max_failures,
                max_preemption_failures=cfg.fault_tolerance.max_preemptions,
            ),
            callbacks=[*(callbacks or []), group_restarts(cfg)],
        ),
    )


# Ray Train V2's record of a run's reported checkpoints, in its run folder (its CheckpointManager's state).
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"


def set_aside_torn_snapshot(run_dir: str) -> str | None:
    """Ray Train's controller rewrites its checkpoint manager snapshot in place, not atomically: a head killed
    mid-write leaves it empty or torn, and every later TrainController of the run then dies in its ``__init__``
    (``CheckpointManagerInitializationError``), so every restart fails the same way and the run is given up. The file
    holds nothing unbroken resumes from -- its own manifests say which checkpoints exist and which are whole -- so a
    torn one is moved aside (kept, ``.torn``, for a person) and Ray Train starts its record afresh. Written by hand:
    Ray Train has no repair for it. Returns why it was moved, or None when it reads (or is absent)."""
    url = join(run_dir, RAY_TRAIN_SNAPSHOT)
    try:
        json.loads(read_bytes(url))
        return None
    except FileNotFoundError:
        return None
    except ValueError as e:  # empty, torn, not UTF-8 (UnicodeDecodeError is a ValueError)
        fs, path = fs_and_path(url)
        fs.mv(path, path + ".torn")
        why = f"{url} was torn ({e}): moved aside; Ray Train keeps its checkpoint record afresh"
        log.warning("%s", why)
        return why


def lighthouse(cfg: Config) -> dict | None:
    """torchft's lighthouse, for an engine whose replicas are torchft's (live recovery; None: any other): a quorum
    of one live replica is enough to step, a replica silent for ``replica_timeout_s`` is left out, a quorum waits
    that long for a replica joining it."""
    ft = cfg.fault_tolerance
    if not engine_of(cfg).torchft:
        return None
    ms = int(ft.replica_timeout_s * 1000)
    return {"min_replicas": 1, "heartbeat_timeout_ms": ms, "join_timeout_ms": ms, "quorum_tick_ms": 50}


def scaling_config(cfg: Config) -> ScalingConfig:
    """Ray Train's ScalingConfig: a fixed number of workers, or ``(min, max)`` for its elastic policy (it restarts
    with as many workers as fit after a node is lost and grows back every ``cluster.resize_check_s``)."""
    from ray.train.v2.api.config import ScalingConfig  # V2's, as in build_trainer: it takes a (min, max) range

    c = cfg.cluster
    return ScalingConfig(
        num_workers=cfg.workers if c.elastic else cfg.workers[1],  # live recovery's standbys included
        use_gpu=c.use_gpu,
        resources_per_worker={"CPU": c.cpus_per_worker},
        # read by Ray Train's elastic scaling policy alone: a fixed number of workers never looks at it
        elastic_resize_monitor_interval_s=c.resize_check_s,
    )


def root_cause(e: BaseException) -> JobFailure:
    """The exception a worker raised, under Ray Train's wrappers: its type name, its classes, first message line."""
    failures = getattr(e, "worker_failures", None) or {}
    if failures:
        e = failures[min(failures)]
    e = getattr(e, "cause", None) or e  # RayTaskError(ValueError) -> the ValueError the worker raised
    name = type(e).__name__.removeprefix("RayTaskError(").removesuffix(")")
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    # The class chain too: a policy that refuses to retry ValueError must see peft's NoMatchingPeftModuleError.
    kinds = [c.__name__ for c in type(e).__mro__ if c not in (object, BaseException)]
    # A preemption Ray Train could not absorb (the just-in-time checkpoint is saved): the platform's doing, which
    # the watchdog keeps out of the run's failure budget.
    preempted = "Preempted" in (name, *kinds)
    message = (lines[0] if lines else "")[:500]
    return JobFailure(type=name, message=message, kinds=kinds, preempted=preempted, user=user_error(e) is not None)


def fit_outcome(argv: list[str]) -> dict[str, Any]:
    """What the attempt's run host runs (ray_jobs/host.py): the job spec in ``argv`` read in the host's own process
    (its credentials from the job's environment, its output masked as the driver's is), then :func:`fit`."""
    mask_output()
    return fit(*job_spec("ray_jobs.job", JobSpec, argv))


def fit(spec: JobSpec, cfg: Config) -> dict[str, Any]:
    """Train what the job spec says, to its end: ``{"result": {metrics, checkpoint}}``, or ``{"failure": <the root
    cause's UNBROKEN_FAILURE line>}`` -- in the driver, or in its run host."""
    os.environ.setdefault(POLL_INTERVAL_ENV, POLL_INTERVAL_S)
    # One row-trace group per job (tests): a live replica replaced mid-job trains in the same group as its peers.
    trainer = build_trainer(cfg, loop_config(spec, cfg).set(group=time.time_ns()))
    try:
        result = trainer.fit()
    except Exception as e:  # Ray wraps worker errors; name the root cause plainly for the watchdog's policy
        log.error("training failed: %s", e)
        return {"failure": root_cause(e).line()}
    ckpt = result.checkpoint.path if result.checkpoint else None
    return {"result": {"metrics": result.metrics, "checkpoint": ckpt}}


def main(argv: list[str] | None = None) -> int:
    """``python -m ray_jobs.job --spec <url> [--attach | --stop-host]``: train in this driver, or with
    ``fault_tolerance.run_host`` in the attempt's run host (``--attach``: a driver for an attempt whose host already
    trains; ``--stop-host``: stop the attempt's run host, and with it its controller and workers)."""
    import argparse

    mask_output()  # the job's log never shows a credential (ray_jobs/secrets.py); its workers mask their own
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="ray_jobs.job", add_help=False)
    parser.add_argument("--attach", action="store_true")
    parser.add_argument("--stop-host", action="store_true")
    parser.add_argument("--spec", required=True)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.stop_host:  # the control plane stopping the attempt's run host (control/runhost.py): storage unread
        from ray_jobs.host import STOP_LINE, stop

        print(f"{STOP_LINE} {stop(known.spec)}", flush=True)
        return 0
    given = ["--spec", known.spec, *rest]
    spec, cfg = job_spec("ray_jobs.job", JobSpec, given)  # a bad spec is named here, in the driver's log
    ft = cfg.fault_tolerance
    if cfg.hosted or known.attach:
        from ray_jobs.host import drive

        off_head = bool(cfg.cluster.gcs_ft)  # the head may go: the host on a worker node
        outcome = drive(known.spec, fit_outcome, given, ft.run_host_orphan_s, known.attach, off_head)
    else:
        outcome = fit(spec, cfg)
    if "result" in outcome:
        print("UNBROKEN_RESULT " + json.dumps(outcome["result"]), flush=True)
        return 0
    print(outcome["failure"], flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
