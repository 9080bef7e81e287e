"""How an attempt of a run starts, and how a succeeded run closes: one way each for the finetune flow (its
record-attempt and record-success tasks) and the watchdog (a restart; closing a run no flow is left to close).

An attempt is recorded under the run's lease (control/registry.begin_attempt: a flow is refused while another attempt
is in flight) with its job spec, written under that lease once the attempt is known to be the caller's -- a refused
flow never overwrites the spec of the attempt that won."""

from __future__ import annotations

from control import lease as leases
from control import registry, series
from control.backends import ClusterHandle, ClusterSeen
from control.cluster import release
from control.jobs import write_job_spec
from control.logs import run_logger
from control.records.series import Verdict
from ray_jobs.config import Config
from ray_jobs.contracts.job_spec import AttemptInputs


def start_attempt(
    cfg: Config,
    cluster: ClusterSeen,
    dataset_id: str,
    inputs: AttemptInputs,
    *,
    resume_from: str | None = None,
    started_by: str = "finetune-flow",
    lease: leases.Lease | None = None,
    flow_run_id: str | None = None,
    trials: list[str] | None = None,
) -> tuple[int, str]:
    """Record a new attempt on ``cluster`` with what it is given (``inputs``: the run record keeps them, the job spec
    carries them) and write its job spec; returns (attempt, job spec URL). A flow passes no ``lease`` (the write
    takes the run's); a watchdog the one it holds (fenced). ``trials``: a search's trials' run names."""
    specs: dict[int, str] = {}

    def job_spec(attempt: int) -> None:
        specs[attempt] = write_job_spec(cfg, attempt, inputs, resume_from)

    attempt = registry.begin_attempt(
        cfg,
        cluster,
        dataset_id,
        inputs,
        resume_from=resume_from,
        started_by=started_by,
        trials=trials,
        lease=lease,
        flow_run_id=flow_run_id,
        job_spec=job_spec,
    )
    return attempt, specs[attempt]


def close_run(cfg: Config, handle: ClusterHandle | None) -> Verdict | None:
    """Close a succeeded run, the same whoever closes it -- its flow once the job succeeded, or the watchdog when no
    flow is left to (or its flow did not within decide.CLOSE_GRACE_S): score it against its series' champion (the
    verdict, or None), then release its cluster unless ``cluster.keep_running`` (``handle``: the run's cluster; None
    when there is none to release). Harmless twice: the promotion gate keeps its first verdict, a release of what is
    gone does nothing -- a closing that raised midway is done again whole. The caller then marks the record closed
    (the flow: registry.closed; the watchdog: its fenced save)."""
    verdict = series.finish_run(cfg.storage, cfg.name)
    if handle is not None:
        release_unless_kept(cfg, handle)
    return verdict


def release_unless_kept(cfg: Config, handle: ClusterHandle) -> None:
    """This run is done with its cluster: release it (control/cluster.release), unless ``cluster.keep_running``."""
    if cfg.cluster.keep_running:
        run_logger().info("leaving the Ray cluster running (cluster.keep_running): %s", handle.dashboard_url)
    else:
        release(cfg, handle, cfg.name)
