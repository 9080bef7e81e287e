"""The series registry ``<storage>/series/<series>/series.json``: the lineage of runs that retrain one model.

A series is what a platform team retrains on every new drop of data: runs in order, each with the dataset it
trained on, the run it was warm-started from, its score on the series' fixed eval set, and whether it was promoted
to champion. The record is typed (control/records/series.py); the run registry stays the truth about a run's state
(``runs/<run>/run.json``), this file holds only lineage.

- ``lineage``: the record's store (read, and change under the series' lease) and the flow's questions of it.
- ``promotion``: the gate a succeeded run passes to become champion, and the champion pointer ``champion.json``.
- ``retention``: what is deleted once a run succeeded, and what never is.
- ``search``: a hyperparameter search's trials as runs of the series, and its winner put to the gate.
- ``views``: the runs table and a run's lineage lines, as people read them.
"""

from control.series.lineage import (
    WarmStart,
    already_trained,
    begin_run,
    check_eval_source,
    load,
    pinned_eval,
    recipe,
    run_of_flow_run,
    state_of,
    trained_this_recipe,
    warm_start,
)
from control.series.promotion import champion, decide, folder_manifest, score_of, scored
from control.series.retention import trim_checkpoints
from control.series.search import (
    end_unfinished,
    final_model,
    finish_run,
    lost_steps,
    record_trials,
    sync_trials,
    winner,
)
from control.series.views import SeriesRow, format_table, lineage_lines, table

__all__ = [
    "SeriesRow",
    "WarmStart",
    "already_trained",
    "begin_run",
    "champion",
    "check_eval_source",
    "decide",
    "end_unfinished",
    "final_model",
    "finish_run",
    "folder_manifest",
    "format_table",
    "lineage_lines",
    "load",
    "lost_steps",
    "pinned_eval",
    "recipe",
    "record_trials",
    "run_of_flow_run",
    "score_of",
    "scored",
    "state_of",
    "sync_trials",
    "table",
    "trained_this_recipe",
    "trim_checkpoints",
    "warm_start",
    "winner",
]
