"""Verifiable rewards for the addition demo (configs/demo-grpo.yaml): no reward model, just a check of the answer.

Each is called as TRL's GRPO calls a reward function: the prompts (``"35+79="``), the sampled completions, and the
record's own completion as ``answer`` (unused: the sum is computed from the prompt), one reward per completion.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"\s*(\d+)")


def _sum(prompt: str) -> int | None:
    left, _, right = prompt.rstrip().rstrip("=").partition("+")
    return int(left) + int(right) if left.strip().isdigit() and right.strip().isdigit() else None


def correct(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's number is the prompt's sum, else 0.0."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        m = _NUMBER.match(completion)
        out.append(float(m is not None and int(m.group(1)) == _sum(prompt)))
    return out


def digits_right(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """The share of the sum's digits the completion's number has right, from the last digit on (partial credit: a
    denser signal than ``correct`` while the model still errs in a digit or two)."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        m, want = _NUMBER.match(completion), _sum(prompt)
        if m is None or want is None:
            out.append(0.0)
            continue
        got, target = m.group(1)[::-1], str(want)[::-1]
        same = sum(a == b for a, b in zip(got, target, strict=False))
        out.append(same / max(len(got), len(target)))
    return out


def digits_only(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion is a number and nothing else (the model stops after its answer)."""
    return [float(c.strip().isdigit()) for c in completions]


def starts_with_digit(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion starts with a digit: a shaping reward an untrained model already earns at times (the
    tests' Ray runs train on it from the untrained built-in model)."""
    return [float(c[:1].isdigit()) for c in completions]
