"""Generate the KTO demo's unpaired preference records: an addition prompt and one completion, labelled desirable
when it is the sum and undesirable when it is a wrong one (off by one or by ten, or the sum with a stray digit after
it) -- half of each, so KTO's desirable and undesirable weights need no rebalancing.

    python configs/data/make_unpaired.py > configs/data/unpaired.jsonl

TRL's unpaired preference shape (``prompt``/``completion``/``label``, plain strings and a boolean), detected by
``data.format: auto``. Deterministic (fixed seed), so the committed file can be checked against this script.
"""

import json
import random
import sys


def wrong(total: int, rng: random.Random) -> str:
    """A sum that is not ``total``: near it, or it with a digit too many."""
    near = [total + d for d in (-10, -1, 1, 10) if total + d >= 0]
    return str(rng.choice(near)) if rng.random() < 0.5 else f"{total}{rng.randrange(10)}"


def records(n: int = 600, seed: int = 8642, max_digits: int = 2):
    rng = random.Random(seed)
    labels = [True, False] * (n // 2)
    rng.shuffle(labels)
    for label in labels:
        a = rng.randrange(10 ** rng.randint(1, max_digits))
        b = rng.randrange(10 ** rng.randint(1, max_digits))
        yield {"prompt": f"{a}+{b}=", "completion": str(a + b) if label else wrong(a + b, rng), "label": label}


if __name__ == "__main__":
    for rec in records():
        sys.stdout.write(json.dumps(rec) + "\n")
