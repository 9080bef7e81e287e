"""Generate the DPO demo's preference pairs: an addition prompt, the sum as the chosen answer, and as the rejected one
the sum with a stray digit after it (a wrong, longer number) -- what DPO teaches here is to stop after the sum.

    python configs/data/make_preferences.py > configs/data/preferences.jsonl

TRL's preference shape (``prompt``/``chosen``/``rejected``, plain strings), detected by ``data.format: auto``.
Deterministic (fixed seed), so the committed file can be checked against this script.
"""

import json
import random
import sys


def records(n: int = 1000, seed: int = 4321, max_digits: int = 2):
    rng = random.Random(seed)
    for _ in range(n):
        a = rng.randrange(10 ** rng.randint(1, max_digits))
        b = rng.randrange(10 ** rng.randint(1, max_digits))
        yield {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b}{rng.randrange(10)}"}


if __name__ == "__main__":
    for rec in records():
        sys.stdout.write(json.dumps(rec) + "\n")
