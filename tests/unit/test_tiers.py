"""make test's tier and the full tier's rotating shards (tests/tiers.py): which test runs where."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.tiers import SHARDS, commit_shard, parse_shard, selected, shard_of

IDS = [f"tests/chaos/test_x.py::test_{i}" for i in range(300)]


@pytest.mark.parametrize(
    ("full_only", "tier", "shard", "runs"),
    [
        (False, "ci", None, True),  # make test's own: always
        (False, "full", None, True),
        (True, "full", None, True),  # make test-full: everything
        (True, "ci", None, False),  # full-only, no shard: not in make test
    ],
)
def test_which_tier_runs_a_test(full_only: bool, tier: str, shard: tuple | None, runs: bool) -> None:
    assert selected(IDS[0], full_only, tier, shard) is runs


def test_a_shard_named_by_the_marker_wins_over_the_hash() -> None:
    others = [k for k in range(SHARDS) if k != shard_of(IDS[0])]
    assert selected(IDS[0], True, "ci", (others[0], SHARDS), named=others[0])
    assert not selected(IDS[0], True, "ci", (shard_of(IDS[0]), SHARDS), named=others[0])
    assert shard_of(IDS[0], 7, named=others[0]) == shard_of(IDS[0], 7), "another number of shards: the hash's"


def test_the_shards_part_the_full_only_tests_whatever_the_commit() -> None:
    """Every full-only test is in exactly one shard, the shards are about equal, and a test's shard is its id's."""
    parts = [[t for t in IDS if selected(t, True, "ci", (k, SHARDS))] for k in range(SHARDS)]
    assert sorted(t for p in parts for t in p) == sorted(IDS)
    assert all(80 <= len(p) <= 120 for p in parts), [len(p) for p in parts]
    assert [shard_of(t) for t in IDS] == [shard_of(t) for t in IDS]  # stable: sha256 of the id, not hash()


def test_the_commit_chooses_the_shard() -> None:
    shards = {commit_shard(commit=f"{n:08x}" + "0" * 32)[0] for n in range(12)}
    assert shards == set(range(SHARDS))
    assert commit_shard(commit="0000000a" + "f" * 32) == (10 % SHARDS, "0000000a" + "f" * 32)
    assert parse_shard("2/3") == (2, 3) and parse_shard("none") is None and parse_shard(None) is None
    k, n = parse_shard("auto")
    assert n == SHARDS and k == commit_shard()[0]
    with pytest.raises(pytest.UsageError):
        parse_shard("3/3")


def test_make_test_collects_no_full_only_test_but_its_shard_and_says_which_ran() -> None:
    """A real collection of the suite as make test makes it, with shard 1: of the full tier's own tests, exactly
    those its listing puts in shard 1 run, and the session names each of them."""
    make_test = ["--tier", "ci", "--shard", f"1/{SHARDS}", "--list-tiers"]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *make_test, "tests"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    listed = [ln.split("\t")[1:] for ln in out.stdout.splitlines() if ln.startswith("TIER\t")]
    collected = {ln for ln in out.stdout.splitlines() if ln.startswith("tests/")}
    ci = {nodeid for tier, _, nodeid in listed if tier == "ci"}
    shard_1 = {nodeid for tier, k, nodeid in listed if tier == "full" and k == "1"}
    assert shard_1 and {k for tier, k, _ in listed if tier == "full"} == {str(k) for k in range(SHARDS)}
    assert collected == ci | shard_1, "make test's own tests and shard 1's, nothing else"
    assert all(f"from the full tier: {t}" in out.stdout for t in shard_1)
    assert f"shard 1/{SHARDS}: {len(shard_1)} here" in out.stdout
