"""Test-only: which training rows each step used, so a test can prove exact data accounting across world sizes.

``UNBROKEN_TRACE_ROWS=<folder>`` (a local or shared path): every worker appends one JSON line per step to its own
file there, naming the worker group it belongs to (rank 0's start time, broadcast) and each row as (epoch, shard
file, row in shard). :func:`trained_rows` rebuilds what the finished run trained on: for every step, the rows of the
last group that trained it (a restarted group redoes the steps after its checkpoint; the earlier group's copies of
those steps did not count). Unset (always, outside tests): nothing is recorded.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ENV = "UNBROKEN_TRACE_ROWS"


class RowTrace:
    def __init__(self, folder: str, group: int, rank: int, world: int):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"rows-{group}-{rank}.jsonl"
        self.head = {"group": group, "rank": rank, "world": world}
        self.rows: list[list[Any]] = []

    def add(self, epochs, ids: list[tuple[str, int]]) -> None:
        self.rows += [[int(e), f, r] for e, (f, r) in zip(epochs, ids, strict=True)]

    def step_done(self, step: int) -> None:
        self._write({"step": step, "rows": self.rows})
        self.rows = []

    def computed(self, step: int) -> None:
        """Live recovery: the rows of this replica's shares of ``step``, written before its gradients are summed --
        a replica killed after the sum that counted has left them, and a try that did not commit is superseded by
        the next one. :meth:`committed` says whose shares the step took."""
        self._write({"step": step, "computed": self.rows})
        self.rows = []

    def committed(self, step: int, participants: list[int]) -> None:
        self._write({"step": step, "participants": participants})

    def _write(self, rec: dict[str, object]) -> None:  # a JSON line
        with self.path.open("a") as f:
            f.write(json.dumps({**self.head, **rec}) + "\n")


def open_trace(rt) -> RowTrace | None:
    """A trace for this worker when the variable is set (every worker calls this together: one broadcast)."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    group = rt.broadcast_object(time.time_ns())
    return RowTrace(folder, group, rt.rank, rt.world_size)


def trained_rows(folder: str | Path) -> tuple[Counter, list[tuple[int, int, int]]]:
    """(the multiset of (epoch, file, row) the run's final weights trained on, and its world sizes over time: for
    each group that trained steps that counted, in order, (world size, first step, last step))."""
    by_step: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))  # step -> group -> rows
    worlds: dict[int, int] = {}
    computed: dict[tuple[int, int, int], list] = {}  # live recovery: (step, group, rank) -> its last try's rows
    took: dict[tuple[int, int], list[int]] = {}  # live recovery: (step, group) -> the ranks whose shares committed
    for path in Path(folder).glob("rows-*.jsonl"):  # one file per (group, rank), its lines in the order written
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            worlds[rec["group"]] = rec["world"]
            if "computed" in rec:
                computed[rec["step"], rec["group"], rec["rank"]] = rec["computed"]
            elif "participants" in rec:
                took[rec["step"], rec["group"]] = rec["participants"]
            else:
                by_step[rec["step"]][rec["group"]] += [tuple(r) for r in rec["rows"]]
    for (step, group), ranks in took.items():  # a committed step: the shares of those who took part, nobody else's
        by_step[step][group] = [tuple(r) for rank in ranks for r in computed.get((step, group, rank), [])]
    rows: Counter = Counter()
    spans: dict[int, list[int]] = {}
    for step in sorted(by_step):
        last = max(by_step[step])  # the latest group to train this step: its copy is the one that counted
        rows.update(by_step[step][last])
        spans.setdefault(last, [step, step])[1] = step
    return rows, [(worlds[g], lo, hi) for g, (lo, hi) in sorted(spans.items(), key=lambda kv: kv[1][0])]
