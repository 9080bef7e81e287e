"""Weights & Biases: one W&B run per run of ours; every restart rewinds it and writes the kept steps again.

The W&B run id is made from the run's name and storage (``run_id``): every process of the run, on any node, after
any restart, names the same W&B run without remembering anything. A first start opens it with ``id=``. Any later
process (a restart from the checkpoint at step ``s``, or a fresh start after an attempt that logged) opens it with
``resume_from="<id>?_step=0"`` -- W&B's rewind: its history is dropped -- and logs steps ``1..s`` again from the run's
metrics log (which keeps exactly those: ``ray_jobs.train.metrics``), then ``s+1..`` as they are trained: each step
once, the latest attempt's value. Why not rewind to ``s`` alone: W&B writes its file in 32 KiB blocks, so a process
killed (Ray kills rank 0 with its worker group) loses its last block -- a hundred steps or more, many of them at or
below ``s``, which nothing would log again. (``resume=`` is no way either: it refuses or drops every step at or below
the last one logged, which are exactly the steps trained again.)

Offline (the default) every process writes a folder of its own, ``<dir>/wandb/offline-run-<time>-<id>[-n]``, whose
``run-<id>.wandb`` holds its history and, when it rewound, the branch point. ``wandb sync`` of the folders in start
order applies them; :func:`offline_history` does the same here (each folder, in start order, first drops every step
past its branch point, then adds its own steps; a step logged twice without a rewind: the later wins) -- what the
tests read. The latest folder alone holds the whole history. No network in offline mode, no console capture (Ray
collects rank 0's stdout), no git or pip freeze.

Folders: under ``<tracking.wandb.dir>/wandb/``, else ``<storage>/runs/<run>/wandb/`` for local storage; on an object
store under the node's temp dir, each copied up to ``<storage>/runs/<run>/wandb/`` when its process ends the run (W&B
appends to its file, which object stores cannot do; a killed process's folder stays on its node).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ray_jobs.config import WandbConfig
from ray_jobs.storage import is_local, join
from ray_jobs.train.tracking.hub import RunInfo, kept

if TYPE_CHECKING:
    from wandb import Run

MAX_TAG = 64  # W&B's limit on a tag's length
_NOT_ID = re.compile(r"[^A-Za-z0-9_-]+")  # what a W&B run id may not hold


def run_id(run: str, storage: str) -> str:
    """The W&B run id of our run: its name as W&B ids allow (letters, digits, ``-``, ``_``; 64 at most), and a hash
    of storage and name, so that same-named runs on two storage roots are two W&B runs."""
    digest = hashlib.sha256(f"{storage}\n{run}".encode()).hexdigest()[:8]
    return f"{_NOT_ID.sub('-', run)[:55]}-{digest}"


def folder(cfg: WandbConfig, info: RunInfo) -> str:
    """What this node gives W&B as its ``dir``: W&B writes under ``<dir>/wandb/``, so the run folder itself for local
    storage (its W&B folders land in ``<storage>/runs/<run>/wandb/``)."""
    if cfg.dir:
        return cfg.dir
    if is_local(info.storage):
        return os.path.abspath(info.run_dir.removeprefix("file://"))
    return os.path.join(tempfile.gettempdir(), "unbroken-wandb", info.run)


def settings(mode: Literal["offline", "online"]):
    """Quiet, local and light: no console capture or output, no git, code or package snapshot. Made the process's
    W&B settings too (``wandb.setup``): W&B's usage telemetry, sent from a thread of its own at every export and at
    exit, goes by those, not the run's -- a run offline in a process W&B thinks online still calls W&B's server."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    made = wandb.Settings(
        mode=mode,
        silent=True,
        console="off",
        disable_git=True,
        save_code=False,
        x_save_requirements=False,
        reinit="create_new",
    )
    wandb.setup(settings=made)
    return made


class WandbTracker:
    name = "wandb"
    run: Run  # made by ``open``: the hub logs to and closes only a tracker that opened

    def __init__(self, cfg: WandbConfig):
        self.cfg = cfg
        self.links: dict[str, str] = {}

    def open(self, info: RunInfo) -> None:
        quiet = settings(self.cfg.mode)
        import wandb

        self.info, self.dir = info, folder(self.cfg, info)
        os.makedirs(self.dir, exist_ok=True)
        rid = run_id(info.run, info.storage)
        again = info.resumed_step is not None or info.attempt > 0 or bool(offline_parts(self.dir, rid))
        resume_from, first_id = (f"{rid}?_step=0", None) if again else (None, rid)  # None: wandb.init's default
        config = info.params | {
            "unbroken.run": info.run,
            "unbroken.series": info.series,
            "unbroken.dataset": info.dataset_id,
            "unbroken.attempt": info.attempt,
            "unbroken.parent": info.parent,
        }
        tags = [t[:MAX_TAG] for t in (info.series, info.dataset_id and f"dataset:{info.dataset_id}") if t]
        self.run = wandb.init(
            project=self.cfg.project or info.series,
            dir=self.dir,
            name=info.run,
            config=config,
            tags=tags,
            allow_val_change=True,
            settings=quiet,
            id=first_id,
            resume_from=resume_from,
        )
        sync = f"wandb sync --include-offline {os.path.join(self.dir, 'wandb', f'offline-run-*-{rid}*')}"
        online = getattr(self.run, "url", None) if self.cfg.mode == "online" else None
        self.links = {"run_id": rid, "dir": os.path.join(self.dir, "wandb")} | (
            {"url": online} if online else {"sync": sync}
        )
        for step, metrics in kept(info):
            self.run.log(metrics, step=step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str, final_model: str | None) -> None:
        if final_model:
            self.run.summary["final_model"] = final_model
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        _wait_written()
        if self.cfg.dir is None and not is_local(self.info.storage):
            _upload(self.run.settings.sync_dir, join(self.info.run_dir, "wandb"))


def _wait_written() -> None:
    """Stop this process's W&B service, which waits until it has written the run's file: ``finish`` can return
    before that (seen in 4 of 15 rewound runs on a busy machine: the file still empty), and a process Ray kills after
    its train function returned would lose the run's whole history. The next run here starts a service again."""
    import wandb

    wandb.teardown()


def _upload(local: str, target: str) -> None:
    from ray_jobs.storage import fs_and_path

    fs, path = fs_and_path(target)
    fs.put(local, f"{path.rstrip('/')}/{os.path.basename(local)}", recursive=True)


@dataclass
class OfflinePart:
    """One process's offline folder of a W&B run."""

    path: str
    start: float = 0.0  # when it began (s since the epoch)
    branch: int | None = None  # the step it rewound the run to; None: no rewind
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    exit_code: int | None = None  # None: it never finished (killed, or still running)


def offline_parts(root: str, rid: str) -> list[OfflinePart]:
    """The offline folders of W&B run ``rid`` under ``root`` (as given to ``wandb.init(dir=)``), in start order."""
    name = re.compile(r"offline-run-\d{8}_\d{6}-" + re.escape(rid) + r"(-\d+)?")
    found = [
        f
        for f in glob.glob(os.path.join(root, "wandb", "offline-run-*", f"run-{rid}.wandb"))
        if name.fullmatch(os.path.basename(os.path.dirname(f)))
    ]
    return sorted((_part(f) for f in found), key=lambda p: p.start)


def offline_history(root: str, rid: str) -> dict[int, dict[str, float]]:
    """The run's history as ``wandb sync`` of its offline folders makes it: each folder, in start order, drops the
    steps past its branch point, then adds its own."""
    rows: dict[int, dict[str, float]] = {}
    for part in offline_parts(root, rid):
        if part.branch is not None:
            rows = {s: r for s, r in rows.items() if s <= part.branch}
        rows.update(part.history)
    return dict(sorted(rows.items()))


def _part(path: str) -> OfflinePart:
    part = OfflinePart(path)
    for rec in _records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            part.start = rec.run.start_time.seconds + rec.run.start_time.nanos / 1e9
            if rec.run.HasField("branch_point"):
                part.branch = int(rec.run.branch_point.value)
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            part.history[int(row["_step"])] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "exit":
            part.exit_code = rec.exit.exit_code
    return part


def _records(path: str) -> Any:
    """The records of a ``.wandb`` file: LevelDB log framing (a 7-byte file header, then 32 KiB blocks of chunks,
    each behind a 7-byte header: crc, length, type), protobuf ``Record`` inside. ``wandb.sdk.internal.datastore``,
    which read them, is gone in 0.31."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        size, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pos += 7
        if (kind == 0 and size == 0) or pos + size > len(data):  # padding, or the tail of a killed writer
            return
        buf, pos = buf + data[pos : pos + size], pos + size
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = pb.Record()  # ty: ignore[missing-attribute]  # wandb's pb2 star-imports it per protobuf version
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def end_run(cfg: WandbConfig, info: RunInfo, status: str) -> bool:
    """Mark our run's offline W&B run ended as ``status`` when its last process never finished it (its job died):
    one more folder that rewinds to its last step (dropping nothing) and exits. Whether it did. Only offline, and
    only where its folders can be seen from here (local storage or ``tracking.wandb.dir``): an online run that was
    never finished is marked crashed by W&B itself."""
    root = folder(cfg, info)
    if cfg.mode != "offline" or not (cfg.dir or is_local(info.storage)):
        return False
    rid = run_id(info.run, info.storage)
    parts = offline_parts(root, rid)
    if not parts or parts[-1].exit_code is not None:
        return False
    quiet = settings("offline")
    import wandb

    last = max(offline_history(root, rid), default=0)
    run = wandb.init(project=cfg.project or info.series, dir=root, settings=quiet, resume_from=f"{rid}?_step={last}")
    run.finish(exit_code=0 if status == "FINISHED" else 1)
    _wait_written()  # and no W&B service left in this process, nor its address in the environment children inherit
    return True


TRACKER = WandbTracker  # what tracking.wandb switches on (ray_jobs/train/tracking/__init__.py)
