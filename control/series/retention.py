"""Retention once a run succeeded: its older checkpoints (``checkpoint.keep_after_success``) and the final folders of
the series' oldest runs (``series.keep_runs``). Never the champion's folder, an active run's, or a folder an active
run was warm-started from."""

from __future__ import annotations

import logging
import time

from control import registry
from control.records.series import SeriesRecord
from control.series.lineage import state_of
from ray_jobs.storage import Layout, exists, fs_and_path

log = logging.getLogger("unbroken.series")


def trim_checkpoints(storage: str, run: str, keep: int) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints of a succeeded run (or of a search's trial its scheduler
    stopped early: it is over too); returns what was deleted."""
    from ray_jobs import checkpoint as ckpt

    if state_of(storage, run) not in ("succeeded", "stopped-early"):
        return []
    doomed = [url for _, url in ckpt.list_checkpoints(Layout(storage).checkpoints_dir(run))[keep:]]
    for url in doomed:
        _remove_folder(url)
    if doomed:
        log.info("run %s is over: deleted %d older checkpoint(s), kept %d", run, len(doomed), keep)
    return doomed


def _remove_folder(url: str) -> None:
    fs, path = fs_and_path(url)
    fs.rm(path, recursive=True)


def trim_runs(storage: str, rec: SeriesRecord, keep_runs: int | None) -> None:
    """Delete the final folders of the oldest succeeded runs beyond ``keep_runs`` (marking their entries): never
    the champion's, an active run's, or the folder an active run was warm-started from."""
    if keep_runs is None:
        return
    states = {e.run: state_of(storage, e.run) for e in rec.runs}
    protected = {rec.champion} | {e.parent for e in rec.runs if states[e.run] in registry.ACTIVE}
    done = [e for e in rec.runs if states[e.run] == "succeeded" and e.run not in protected]
    for e in done[: max(0, len(done) - keep_runs)]:
        final = Layout(storage).final_model(e.run)
        if exists(final):
            _remove_folder(final)
            e.final_deleted_at = time.time()
            log.info("series %s: deleted the final model of run %s (series.keep_runs=%d)", rec.series, e.run, keep_runs)
