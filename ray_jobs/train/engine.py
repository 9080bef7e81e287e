"""The engine protocol: what a training engine's trainer may override of the native loop.

Every engine's trainer is the native :class:`~ray_jobs.train.trainer.Trainer` or a subclass of it (its row in
``ray_jobs/config/engines.py`` names the class; ``worker.make_trainer`` builds it with :meth:`for_worker`). The
loop's order is the Trainer's: build the model while the data loads, resume or start, then :meth:`fit` -- eval at
the start, the steps up to the end, the last checkpoints -- then score, export, close. An engine overrides the
hooks below that it does differently, each public and documented here; no engine overrides a private method of
``Trainer`` (a test holds it). The HF engine hands :meth:`train_to` to HF's Trainer and calls :meth:`agreed`,
:meth:`advance` and :meth:`after_step` from HF's callback; live recovery replaces :meth:`step` with a step of its
replicas, and leads the metrics log (:meth:`open_log`, :meth:`log_row`) from whichever replica is alive.

Kept by the Trainer for every engine, whatever it overrides: the cursor over the staged rows, the optimizer and LR
schedule, the checkpoints (:class:`~ray_jobs.checkpoint.checkpointer.Checkpointer`), the heartbeat, preemption and
drain notices -- so a killed run of any engine resumes exactly as a native one does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Self

if TYPE_CHECKING:
    from ray_jobs.config import Config
    from ray_jobs.contracts.dataset import DatasetManifest
    from ray_jobs.contracts.job_spec import WorkerSpec
    from ray_jobs.contracts.metrics import MetricsRow
    from ray_jobs.data.reading import ShardRows
    from ray_jobs.train.agreement import Agreed
    from ray_jobs.train.heartbeat import Heartbeat
    from ray_jobs.train.runtime import Runtime


class EngineHooks(Protocol):
    """The hooks of a training engine's trainer (module docstring); ``Trainer`` implements every one."""

    @classmethod
    def for_worker(cls, cfg: Config, spec: WorkerSpec, rt: Runtime, heartbeat: Heartbeat | None) -> Self:
        """This engine's trainer for one worker: its job spec, its runtime, rank 0's heartbeat when the worker
        started one (an engine whose row has ``own_heartbeat`` starts its own)."""
        ...

    # -- building: the model and the data, at once -------------------------------------------------------------------
    def build_model(self) -> Any:
        """The model on this worker's device, wrapped for the run's parallelism (or left for the engine to wrap);
        runs while :meth:`load_data` reads this rank's shards into the node cache."""
        ...

    def load_data(self) -> None:
        """The step plan over the staged rows (``self.plan``), the eval rows and the pad id."""
        ...

    def open_log(self, resumed: int | None) -> None:
        """Rank 0's metrics log and trackers, keeping what was logged up to ``resumed`` (None: a fresh run)."""
        ...

    # -- the steps --------------------------------------------------------------------------------------------------
    def eval_at_start(self) -> None:
        """The eval loss before the first step of a fresh run (step 0's row)."""
        ...

    def train_to(self, end: int) -> None:
        """Train until the loop is at step ``end``: :meth:`step` then :meth:`after_step`, or an engine's own loop
        that ends each optimizer step the same way (:meth:`agreed`, :meth:`advance`, :meth:`after_step`)."""
        ...

    def step(self) -> Agreed:
        """One optimizer step, its outcome agreed by every rank, and the loop state advanced."""
        ...

    def agreed(self, loss: Any, tokens: int, grad_norm: Any) -> Agreed:
        """The step's outcome on every rank (loss, tokens, the checkpoint and preemption flags): one all-reduce."""
        ...

    def advance(self, agreed: Agreed, started: float) -> Agreed:
        """The loop state after a step every rank agreed on (``started``: monotonic)."""
        ...

    def step_row(self, a: Agreed) -> tuple[MetricsRow, bool]:
        """The step's metrics row (and its eval on eval steps), and whether it is the last step."""
        ...

    def extra_columns(self) -> MetricsRow:
        """An engine's own columns of a logged row (DPO's reward accuracy, live recovery's participants)."""
        ...

    def after_step(self, a: Agreed) -> None:
        """The end of a step: its row logged, a finished checkpoint reported, a due one taken, SIGTERM and drain
        notices acted on."""
        ...

    def log_row(self, row: MetricsRow) -> None:
        """Append a metrics row (rank 0's log; the leading replica's under live recovery)."""
        ...

    def evaluate(self, rows: ShardRows | None = None) -> float:
        """The loss on the eval split (or ``rows``) every rank agrees on."""
        ...

    def finish_checkpoints(self, done: bool) -> None:
        """After the last step: the final checkpoint written and reported (``done``), or a write in flight ended."""
        ...

    # -- the end ----------------------------------------------------------------------------------------------------
    def score(self, manifest: DatasetManifest | None) -> float | None:
        """The trained model's loss on the series' pinned eval set (rank 0 writes it for the promotion gate)."""
        ...

    def export_final(self, samples: bool = False) -> str | None:
        """``runs/<run>/final`` (and the sample generations); its URL on the worker that wrote it."""
        ...

    def close(self) -> None:
        """What the engine holds beyond the run, released (live recovery: its replica leaves the quorum)."""
        ...
