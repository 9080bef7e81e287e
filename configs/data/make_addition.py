"""Generate the demo dataset: multi-digit addition as input/target pairs.

    python configs/data/make_addition.py > configs/data/addition.jsonl

Deterministic (fixed seed), so the committed file can be checked against this script. A tiny model visibly
learns this on 2 CPU cores in minutes: first the format, then the low digits, then the carries
(the demo config trains 2500 steps; see README for what it reaches).
"""

import json
import random
import sys


def records(n: int = 6000, seed: int = 1234, max_digits: int = 2):
    rng = random.Random(seed)
    for _ in range(n):
        a = rng.randrange(10 ** rng.randint(1, max_digits))
        b = rng.randrange(10 ** rng.randint(1, max_digits))
        yield {"input": f"{a}+{b}=", "target": str(a + b)}


if __name__ == "__main__":
    for rec in records():
        sys.stdout.write(json.dumps(rec) + "\n")
