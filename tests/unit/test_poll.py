"""One deadline-and-poll loop (ray_jobs/poll.py) for every wait in the product."""

from __future__ import annotations

from ray_jobs.poll import poll_until


class Clock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_returns_the_first_truthy_value_as_soon_as_it_holds() -> None:
    c, calls = Clock(), []

    def ready():
        calls.append(c.now)
        return "up" if c.now >= 1.0 else None

    assert poll_until(ready, 10, every_s=0.25, sleep=c.sleep, clock=lambda: c.now) == "up"
    assert calls == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_gives_up_at_the_deadline_after_one_last_look_and_returns_the_falsy_value() -> None:
    c = Clock()
    assert poll_until(lambda: [], 1.0, every_s=0.3, sleep=c.sleep, clock=lambda: c.now) == []
    assert c.now == 1.0 and round(c.sleeps[-1], 9) == 0.1  # never sleeps past the deadline
