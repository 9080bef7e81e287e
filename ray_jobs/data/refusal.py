"""Why staging refuses what it read, one rule a function over its counts (``spill.counts``: records, rejects,
train_examples, eval_examples): no records at all, more rejected than ``data.max_reject_fraction`` allows, an
empty train or eval split. Staging raises what they say (``staging._check_counts``, in this order); ``unbroken
check`` reads every record as staging does (control/check/scan.py) and refuses exactly what staging would."""

from __future__ import annotations

from collections.abc import Mapping

from ray_jobs.config import DataConfig
from ray_jobs.data.fingerprint import Source


def empty_input(counts: Mapping[str, int], files: list[Source]) -> str | None:
    if counts["records"]:
        return None
    return f"no records found in {names(files)} (empty input)"


def too_many_rejects(counts: Mapping[str, int], data: DataConfig) -> str | None:
    """Rejected records over ``data.max_reject_fraction`` of all (a record dropped by ``data.too_long`` is not
    rejected); the rejects themselves are the caller's to name."""
    total, rejected = counts["records"], counts["rejects"]
    if not rejected or rejected / total <= data.max_reject_fraction:
        return None
    return (
        f"{rejected} of {total} records rejected ({rejected / total:.1%}), over "
        f"data.max_reject_fraction={data.max_reject_fraction}"
    )


def empty_split(counts: Mapping[str, int], split: str, files: list[Source]) -> str | None:
    """A split with no example (``files``: the train split's sources, named when it is empty)."""
    if counts[f"{split}_examples"]:
        return None
    if split == "train":
        return f"data.train: no usable records in {names(files)}"
    return "the eval split is empty: raise data.eval_fraction or set data.eval"


def names(files: list[Source]) -> str:
    return ", ".join(f.url for f in files)
