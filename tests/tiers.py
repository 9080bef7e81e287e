"""The suite's two tiers, by purpose (a pytest plugin loaded by tests/conftest.py).

- ``make test`` (``--tier ci``, what ``.ci/run`` calls): every decision table and unit test, and every *fault
  class* proven at least once on real processes -- plus one rotating shard of the tests only the full tier runs.
- ``make test-full`` (``--tier full``, and plain ``pytest``): everything -- the second and third proofs of a class,
  the long end-to-end variants, the real-model runs.

A test only the full tier runs carries the ``full`` marker: ``@pytest.mark.full(shard=K)`` names its shard (of
:data:`SHARDS`), chosen so that each shard costs each lane about the same (docs/development.md lists them with their
seconds: a hash alone put 666 s in one shard and 42 s in another); without one, its id's hash chooses
(``sha256(nodeid) % N``). ``--shard K/N`` runs shard K; ``auto`` runs shard ``int(commit[:8], 16) % N`` of the
checked-out commit. The partition never changes with the commit, only which part runs: each full-only test runs in
CI at least once every ``N`` landings in expectation, and a landing's shard is known from its commit alone.
docs/development.md's table names, per fault class, the proof in ``make test`` and the repeats in the full tier
(tests/unit/test_docs.py checks it against these markers).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

MARK = "full"  # @pytest.mark.full: run by the full tier only (and by CI in its shard)
SHARDS = 3
ROOT = Path(__file__).resolve().parents[1]


def shard_of(nodeid: str, shards: int = SHARDS, named: int | None = None) -> int:
    """The shard a test belongs to: the one its marker names (with the default number of shards), else a stable
    hash of its id (``tests/...::name[param]``)."""
    if named is not None and shards == SHARDS:
        return named
    return int(hashlib.sha256(nodeid.encode()).hexdigest()[:8], 16) % shards


def named_shard(item: pytest.Item) -> int | None:
    """The shard a full-only test's marker names, if it names one."""
    mark = item.get_closest_marker(MARK)
    return None if mark is None else mark.kwargs.get("shard")


def commit_shard(shards: int = SHARDS, commit: str | None = None) -> tuple[int, str]:
    """(shard, commit) for the checked-out commit (``git rev-parse HEAD``), or ``commit`` when given."""
    if commit is None:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        commit = head.stdout.strip()
    return int(commit[:8], 16) % shards, commit


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard``: None (no shard), ``K/N``, or ``auto`` (the commit's shard of :data:`SHARDS`)."""
    if text in (None, "", "none"):
        return None
    if text == "auto":
        return commit_shard()[0], SHARDS
    k, n = (int(x) for x in text.split("/"))
    if not 0 <= k < n:
        raise pytest.UsageError(f"--shard {text}: K must be 0..N-1")
    return k, n


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tiers", "the suite's tiers (tests/tiers.py)")
    tier = "ci: make test's tier (no test marked full, but those of --shard); full: everything (the default)"
    group.addoption("--tier", choices=("ci", "full"), default="full", help=tier)
    shard = "with --tier ci: also the full-only tests of shard K of N (auto: the checked-out commit's)"
    group.addoption("--shard", default=None, metavar="K/N|auto", help=shard)
    group.addoption("--list-tiers", action="store_true", help="print each test's tier and shard (tier, shard, id)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}(shard=K): run by make test-full only (and by CI in its rotating shard K)"
    )


def selected(nodeid: str, full_only: bool, tier: str, shard: tuple[int, int] | None, named: int | None = None) -> bool:
    """Whether a test runs in ``tier`` (with ``shard`` of the full-only tests; ``named``: the shard its marker names)."""
    if tier == "full" or not full_only:
        return True
    return shard is not None and shard_of(nodeid, shard[1], named) == shard[0]


def listing(items: list[pytest.Item]) -> list[tuple[str, int | None, str]]:
    """(``ci`` or ``full``, the full-only test's shard, its id) of each test."""
    out = []
    for item in items:
        if item.get_closest_marker(MARK) is None:
            out.append(("ci", None, item.nodeid))
        else:
            out.append(("full", shard_of(item.nodeid, SHARDS, named_shard(item)), item.nodeid))
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--list-tiers"):
        for tier, k, nodeid in listing(items):
            print(f"TIER\t{tier}\t{'-' if k is None else k}\t{nodeid}")
    tier, shard = config.getoption("--tier"), parse_shard(config.getoption("--shard"))
    if tier == "full":
        return
    keep, drop = [], []
    for item in items:
        full_only = item.get_closest_marker(MARK) is not None
        (keep if selected(item.nodeid, full_only, tier, shard, named_shard(item)) else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
    in_shard = [i.nodeid for i in keep if i.get_closest_marker(MARK) is not None]
    what = f"shard {shard[0]}/{shard[1]}" if shard else "no shard"
    if config.getoption("--shard") == "auto":
        what += f" (commit {commit_shard()[1][:12]})"
    print(f"\ntier ci: {len(keep)} tests; the full tier's own, {what}: {len(in_shard)} here, {len(drop)} not")
    for nodeid in in_shard:
        print(f"  from the full tier: {nodeid}")
