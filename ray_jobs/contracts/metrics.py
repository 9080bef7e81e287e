"""One row of a run's metrics log (``runs/<run>/metrics.jsonl``, or its segments ``runs/<run>/metrics/`` on an
object store): written by rank 0 (under live recovery, by the replica that leads), read by the flow's progress line
and report, the trackers' exactly-once replay, the watchdog's last step and a series' table.

A row is flat: ``step``, then the columns logged at that step, each a number -- ``loss``, ``grad_norm``, ``lr``,
``tokens_seen``, ``tokens_per_s``, ``elapsed_s`` on log steps; ``eval_loss`` on eval steps; ``ckpt_stall_s`` where a
checkpoint stalled the step; ``participants`` and ``heals`` under live recovery; ``reward_accuracy``,
``reward_margin`` (and their ``eval_`` twins) for preference tuning; ``time`` (when it was written). The columns are
open, not a closed model: an engine's own metrics go to the trackers as they are, and a tracker logs whatever a row
holds. What is fixed is the value type: a JSON number (an int where it counts something), never a string or a
nested object -- so a tracker or a chart never meets anything it cannot plot. The log is append-only and rows are
never rewritten, so it has no schema version; a row a reader cannot parse (a writer's half-written last line) is
not a row yet."""

from __future__ import annotations

MetricValue = int | float
MetricsRow = dict[str, MetricValue]
