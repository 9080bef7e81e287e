"""Reward functions for the GRPO tests (``tests.unit.grpo_rewards:<name>``): well-behaved ones and each way a user's
can fail."""

from __future__ import annotations

import threading


def starts_with_digit(prompts, completions, **kwargs):
    return [float(c[:1].isdigit()) for c in completions]


def raises(prompts, completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 5:  # HF's count of this engine's steps
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(completions)


def too_few(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def not_numbers(prompts, completions, **kwargs):
    return ["yes"] * len(completions)


def hangs(prompts, completions, **kwargs):
    threading.Event().wait(3600)


NOT_CALLABLE = 3
