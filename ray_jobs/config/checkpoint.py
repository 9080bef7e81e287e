"""``checkpoint``: when checkpoints are taken, how many are kept, and whether they are written in the background."""

from __future__ import annotations

from pydantic import Field

from ray_jobs.config.base import Section


class CheckpointConfig(Section):
    every_steps: int = Field(100, ge=0)
    """Checkpoint every N optimizer steps; 0 = not by steps. The last step is always checkpointed."""
    saves_per_epoch: int | None = Field(None, ge=1)
    """Instead of ``every_steps``: checkpoint this many times per pass over the data (every round(steps per epoch /
    N) steps, the steps per epoch known once the data is staged)."""
    every_minutes: float = Field(0.0, ge=0)
    """Also checkpoint when this many minutes passed since the last one (15-30 on real runs); 0 = off."""
    num_to_keep: int = Field(3, ge=1)
    """Keep this many checkpoints (Ray Train's CheckpointConfig): the newest, or the best by ``keep_best_by``."""
    keep_best_by: str | None = None
    """Keep the best checkpoints by this reported metric (lower is better, e.g. ``eval_loss``) instead of the newest."""
    async_write: bool = True
    """Write checkpoints on a background thread; the loop only waits while state is copied to host memory."""
    keep_after_success: int = Field(1, ge=0)
    """Once a run succeeded, delete all but this many of its newest checkpoints (its final model is kept)."""
