"""``fault_tolerance``: restart budgets, stall limits per phase, the heartbeat and preemption handling."""

from __future__ import annotations

from pydantic import Field

from ray_jobs.config.base import Section


class PhaseStallConfig(Section):
    starting: float = Field(1800.0, gt=0)
    """Seconds from submitting a job to its first heartbeat (Ray schedules workers, ships the code)."""
    loading: float = Field(1800.0, gt=0)
    """Seconds for loading the model, the data and a checkpoint."""
    evaluating: float = Field(1800.0, gt=0)
    """Seconds one eval pass may take."""
    checkpointing: float = Field(1800.0, gt=0)
    """Seconds a synchronous checkpoint (the last step's, a preemption's) may take."""
    exporting: float = Field(3600.0, gt=0)
    """Seconds writing the final model folder may take (merging LoRA, multi-GB uploads)."""


class FaultToleranceConfig(Section):
    max_failures: int = Field(2, ge=-1)
    """Worker-group restarts Ray Train does inside one job (FailureConfig); -1 = unlimited."""
    max_restarts: int = Field(3, ge=0)
    """Job resubmissions the watchdog may do for one run."""
    restart_backoff_s: float = Field(2.0, ge=0)
    """The watchdog waits this long after detecting trouble before the first restart, doubling for each further one
    (2, 4, 8 ... s up to ``restart_backoff_max_s``): a one-off fault is back at once, a crash loop slows down."""
    restart_backoff_max_s: float = Field(600.0, ge=0)
    """Cap on that wait."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """A training job whose heartbeat shows no new step for this long is treated as hung (the ``training`` phase;
    other phases have their own limits in ``phase_stall_s``)."""
    phase_stall_s: PhaseStallConfig = PhaseStallConfig()
    """How long a job may stay in each non-training phase before it counts as hung."""
    confirm_s: float = Field(30.0, ge=0)
    """An ambiguous sign of trouble (the Jobs API unreachable, a 5xx or 401, a job the cluster suddenly does not
    know) is acted on only when it held this long, over several observations. A definitive one (the job FAILED,
    a phase over its limit) is acted on at once."""
    progress_resets_budget_steps: int = Field(100, ge=0)
    """An attempt that trained at least this many new steps before it failed resets the restart count: a long run
    on flaky nodes is not given up on for failures spread over days. 0 = never reset."""
    heartbeat_every_s: float = Field(5.0, gt=0)
    """How often rank 0 refreshes ``runs/<run>/heartbeat.json`` while training."""
    preemption_grace_s: float = Field(30.0, gt=0)
    """After SIGTERM, a worker waits at most this long for its just-in-time checkpoint before exiting."""
    max_preemptions: int = Field(-1, ge=-1)
    """Node preemptions (a drain notice with a deadline: a spot reclaim, ``ray drain-node``) Ray Train absorbs
    inside one job, counted apart from ``max_failures`` (``FailureConfig.max_preemption_failures``), and the
    watchdog's resubmissions of a job that ended preempted, counted apart from ``max_restarts`` (since the last
    attempt that trained ``progress_resets_budget_steps``), each after a backoff that doubles like a restart's;
    -1 = unlimited. Each one costs no step: every rank checkpoints at once and waits for the restart."""
    live_recovery: bool = False
    """Keep training when a worker is lost (DDP, full or LoRA, 2+ fixed workers): each worker is a torchft replica
    group; Ray Train replaces only the lost one while the others keep stepping and take its share of every step's
    micro-batches (the rows of each step, and at two workers its bits, are the uninterrupted run's); the newcomer
    receives the whole training state from a live peer, not from storage. Storage checkpoints stay for what it
    cannot cover (the driver, the head, every worker at once)."""
    run_host: bool = False
    """Train in a detached actor per attempt that outlives the job's driver (ray_jobs/host.py): a driver killed
    mid-run leaves the training stepping -- no restart, no step lost -- and a new driver for the attempt re-attaches
    to it (the watchdog and the finetune flow's watch start one when the Jobs API says the job ended while its
    heartbeat moves, or when the node its driver ran on is dead). The host runs beside the driver (on a worker node
    with ``cluster.gcs_ft``, which needs it). A Ray job's: local mode (``unbroken train``) has no driver to lose, and a
    search is refused it (its trials run under Ray Tune's driver). False: a driver's death ends the job, and the
    watchdog restarts the run from its newest checkpoint."""
    run_host_orphan_s: float = Field(300.0, gt=0)
    """With ``run_host``: a host no driver has waited on for this long ends, and its training with it (nobody is
    left to relay its end). The watchdog re-attaches a driver well within it while it looks after the run."""
    standby_replicas: int = Field(0, ge=0)
    """With ``live_recovery``: workers beyond ``cluster.num_workers`` that take part in every step's quorum and
    optimizer step but compute no share while every data rank has its worker (a warm standby: it holds the whole
    training state). When a worker is lost, a standby computes its share from the next step on -- no step runs with
    a worker computing two shares while Ray Train starts the replacement, which becomes the new standby. Each costs a
    worker's resources (and its optimizer step), never a changed result: the step's rows and bits are the same."""
    replica_timeout_s: float = Field(0.5, gt=0)
    """With ``live_recovery``: a replica silent this long (torchft's lighthouse heartbeat, sent every 100 ms by its
    manager's own thread) leaves the next step's quorum, and the others step without it: a lost worker costs about
    this much (measured: 0.5 s to the next committed step at 0.5, 1.0 s at 1.0). Lower recovers sooner; too low
    drops a replica that is only slow."""
    preemption_poll_s: float = Field(2.0, gt=0)
    """How often the ranks ask Ray Train whether a node of theirs is being drained (one barrier across ranks, at a
    step boundary). Ray's own watcher polls the cluster every 5 s; a notice is acted on within both."""
