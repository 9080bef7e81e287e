"""TensorBoard event files (tensorboardX's writer, which Ray already installs), superseded past a resume by
TensorBoard's own mechanism.

Every process that writes opens a new event file with ``purge_step=0``. The file then begins with a
``SessionLog.START`` at step 0, and TensorBoard's readers drop every point of the earlier files from there; a resumed
process (from the checkpoint at step ``s``) then writes steps ``1..s`` again from the run's metrics log, which keeps
exactly those, and ``s+1..`` as they are trained. So each step shows once, with the latest attempt's value. Why not
``purge_step = s + 1`` and keep the older files' ``1..s``: a killed writer loses what it had not flushed (up to
``flush_secs`` of points, often all of them in a short run), steps at or below ``s`` among them, which nothing would
write again. File names end in the time in nanoseconds: tensorboardX names a file by the second and the host alone,
so two writers within one second on one host would overwrite each other, and readers take files in name order, which
must be the order they were written in.

On an object store the files are written on this node (an event file is appended to, which object stores cannot
do) and copied up after each flush, at most every ``SYNC_S`` seconds and at close.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import TYPE_CHECKING

from ray_jobs.config import TensorBoardConfig
from ray_jobs.storage import is_local, join
from ray_jobs.train.tracking.hub import RunInfo, kept

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter

SYNC_S = 10.0


class TensorBoardTracker:
    name = "tensorboard"
    writer: SummaryWriter  # made by ``open``: the hub logs to and closes only a tracker that opened

    def __init__(self, cfg: TensorBoardConfig):
        self.cfg = cfg
        self.synced_at = 0.0
        self.links: dict[str, str] = {}

    def open(self, info: RunInfo) -> None:
        from tensorboardX import SummaryWriter

        self.target = self.cfg.dir or join(info.run_dir, "tensorboard")
        self.local = is_local(self.target)
        folder = self.target if self.local else tempfile.mkdtemp(prefix="unbroken-tensorboard-")
        self.writer = SummaryWriter(folder, purge_step=0, flush_secs=5, filename_suffix=f".{time.time_ns()}")
        self.folder = folder
        self.links = {"dir": self.target, "view": f"tensorboard --logdir {self.target}"}
        self.writer.add_text(
            "run",
            f"{info.run} (series {info.series}, dataset {info.dataset_id}, attempt {info.attempt})",
            global_step=0,
        )
        for step, metrics in kept(info):
            self.log(step, metrics)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        if not self.local and time.monotonic() - self.synced_at >= SYNC_S:
            self.writer.flush()
            self._sync()

    def close(self, status: str, final_model: str | None) -> None:
        self.writer.close()
        if not self.local:
            self._sync()

    def _sync(self) -> None:
        from ray_jobs.storage import fs_and_path

        fs, path = fs_and_path(self.target)
        for name in os.listdir(self.folder):
            fs.put_file(os.path.join(self.folder, name), f"{path.rstrip('/')}/{name}")
        self.synced_at = time.monotonic()


TRACKER = TensorBoardTracker  # what tracking.tensorboard switches on (ray_jobs/train/tracking/__init__.py)
