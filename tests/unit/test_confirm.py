"""One confirmation rule for ambiguous signs (control/confirm.py), as the flow's watch and the watchdog use it."""

from __future__ import annotations

import pytest

from control.confirm import Suspicion


@pytest.mark.parametrize(
    ("first_at", "looks", "now", "confirm_s", "min_looks", "held"),
    [
        (0.0, 1, 100.0, 30.0, 2, False),  # one look, however long ago the first was
        (0.0, 2, 29.0, 30.0, 2, False),  # two looks, not held long enough
        (0.0, 2, 30.0, 30.0, 2, True),  # the watchdog's rule: 30 s over two looks
        (0.0, 4, 31.0, 30.0, 5, False),  # the flow's watch polls every 0.5 s: five polls
        (0.0, 5, 31.0, 30.0, 5, True),
        (0.0, 1, 0.0, 0.0, 1, True),  # no confirmation asked for: the first look
    ],
)
def test_a_sign_is_confirmed_once_it_held_long_enough_over_enough_looks(
    first_at, looks, now, confirm_s, min_looks, held
) -> None:
    assert Suspicion(first_at, looks).held(now, confirm_s, min_looks) is held


def test_each_look_counts_once() -> None:
    s = Suspicion(10.0).seen().seen()
    assert s.observations == 2 and s.held_s(25.0) == 15.0
