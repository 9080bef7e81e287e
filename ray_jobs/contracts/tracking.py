"""``runs/<run>/tracking.json``: where each experiment tracker keeps the run (a folder, an MLflow run id, a web page)
and how to look at it. Written by rank 0 as each tracker opens (ray_jobs/train/tracking/hub.py), read by the flow's
tracking artifact (tasks/report.py) and a person."""

from __future__ import annotations

from typing import Any, ClassVar

from ray_jobs.contracts.base import Record

# A tracker's links: what each is (``dir``, ``run_id``, ``experiment``...) -> a path, id or command. The keys of
# ``LOOK`` say how to look at the run (a web page, a command, how to sync it), in that preference; the rest, where it is.
Links = dict[str, str]
LOOK = ("url", "view", "sync")


class TrackingLinks(Record):
    """Every tracker's links for one run. Version 1 kept the trackers at the top level (``{name: links}``)."""

    SCHEMA: ClassVar[int] = 2
    schema_version: int = 2
    trackers: dict[str, Links] = {}

    @classmethod
    def migrate(cls, tree: dict[str, Any]) -> dict[str, Any]:
        if "schema_version" not in tree:  # version 1: tracker name -> links, nothing else
            return {"schema_version": 2, "trackers": tree}
        return tree

    def look(self, name: str) -> str:
        """How to look at tracker ``name``'s run: its web page, else the command, else how to sync it ('' if none)."""
        got = self.trackers.get(name, {})
        return next((got[k] for k in LOOK if got.get(k)), "")

    def where(self, name: str) -> Links:
        """Where tracker ``name`` keeps the run: its links but those of :data:`LOOK`."""
        return {k: v for k, v in self.trackers.get(name, {}).items() if k not in LOOK}
