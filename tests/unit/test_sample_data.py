"""The shipped demo data is exactly what its generator makes (so it can be regenerated, and is not hand-edited)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, SAMPLE_DATA


def test_committed_sample_data_matches_its_generator() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "configs" / "data" / "make_addition.py")], capture_output=True, check=True
    ).stdout
    assert out == SAMPLE_DATA.read_bytes()
    assert len(out.splitlines()) == 6000
