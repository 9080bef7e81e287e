"""The shipped sample data is exactly what its generators make (so it can be regenerated, and is not hand-edited)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

DATA = ROOT / "configs" / "data"


@pytest.mark.parametrize(("generator", "data", "records"), [("make_addition.py", "addition.jsonl", 6000),
                                                           ("make_chat.py", "chat_json.jsonl", 600),
                                                           ("make_preferences.py", "preferences.jsonl", 1000),
                                                           ("make_unpaired.py", "unpaired.jsonl", 600)])  # fmt: skip
def test_committed_sample_data_matches_its_generator(generator: str, data: str, records: int) -> None:
    out = subprocess.run([sys.executable, str(DATA / generator)], capture_output=True, check=True).stdout
    assert out == (DATA / data).read_bytes()
    assert len(out.splitlines()) == records


def test_the_chat_set_has_multi_turn_conversations_ending_with_the_assistant() -> None:
    convs = [json.loads(line)["messages"] for line in (DATA / "chat_json.jsonl").read_text().splitlines()]
    assert all(c[-1]["role"] == "assistant" for c in convs)
    assert sum(len(c) > 2 for c in convs) > len(convs) // 3, "enough multi-turn records to exercise all_assistant"


def test_the_unpaired_set_is_half_desirable_and_each_undesirable_completion_is_a_wrong_sum() -> None:
    records = [json.loads(line) for line in (DATA / "unpaired.jsonl").read_text().splitlines()]
    assert sum(r["label"] for r in records) == len(records) // 2
    for r in records:
        a, b = (int(x) for x in r["prompt"].rstrip("=").split("+"))
        assert (r["completion"] == str(a + b)) == r["label"], r
