"""How an attempt of a run starts, one way for the finetune flow (its record-attempt task) and the watchdog (a
restart): the attempt recorded under the run's lease (control/registry.begin_attempt: a flow is refused while another
attempt is in flight) with its job spec, written under that lease once the attempt is known to be the caller's -- a
refused flow never overwrites the spec of the attempt that won."""

from __future__ import annotations

from dataclasses import dataclass

from control import lease as leases
from control import registry
from control.backends import ClusterSeen
from control.jobs import write_job_spec
from control.records.run import AttemptInputs
from ray_jobs.config import Config


@dataclass(frozen=True)
class JobInputs:
    """What an attempt's job is given besides its config and where it resumes (control/jobs.write_job_spec)."""

    manifest_url: str  # the staged dataset
    model_path: str  # the weights to start from: the base model, or a warm start's folder
    score_manifest_url: str | None = None  # the series' pinned eval set the finished model is scored on
    parent: str | None = None  # the series run it warm-starts from


def start_attempt(
    cfg: Config,
    cluster: ClusterSeen,
    dataset_id: str,
    job: JobInputs,
    extra: AttemptInputs,
    *,
    resume_from: str | None = None,
    started_by: str = "finetune-flow",
    lease: leases.Lease | None = None,
    flow_run_id: str | None = None,
) -> tuple[int, str]:
    """Record a new attempt on ``cluster`` (``extra``: what the record keeps of the run's inputs) and write its job
    spec; returns (attempt, job spec URL). A flow passes no ``lease`` (the write takes the run's); a watchdog the one
    it holds (fenced)."""
    specs: dict[int, str] = {}

    def job_spec(attempt: int) -> None:
        specs[attempt] = write_job_spec(cfg, attempt, job.manifest_url, job.model_path, resume_from,
                                        job.score_manifest_url, job.parent)  # fmt: skip

    attempt = registry.begin_attempt(cfg, cluster, dataset_id, resume_from=resume_from, started_by=started_by,
                                     extra=extra, lease=lease, flow_run_id=flow_run_id, job_spec=job_spec)  # fmt: skip
    return attempt, specs[attempt]
