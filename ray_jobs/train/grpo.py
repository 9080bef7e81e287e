"""GRPO (``train.method: grpo``) on the ``hf`` engine: TRL's ``GRPOTrainer`` samples completions for each prompt,
scores them by ``train.rewards`` and steps on their group advantages, inside unbroken's loop (``hf.py``).

What unbroken keeps, so a killed run resumes exactly:

- the prompts come from unbroken's cursor: a step's rows are this worker's prompts (staged one a row,
  ``data.packing`` off), each repeated ``num_generations`` times in a row -- a prompt's whole group on one worker,
  so TRL's gather over the ranks keeps every group together -- and the step's whole generation batch is handed to
  TRL at each of its micro-batches (TRL samples at the first, then takes its slices);
- one sampling per optimizer step (``steps_per_generation`` = the step's micro-batches, ``num_iterations`` 1): no
  completion is buffered across a step's end, so a checkpoint holds everything the next step draws on -- the
  weights, the optimizer, the cursor and the RNG the sampling draws from (restored as every engine's is);
- the prompt's token ids are the staged ones (TRL's own tokenization is skipped): what staging tokenized, checked
  and counted is what is sampled from; TRL decodes them for the reward functions' ``prompts``;
- each reward function is called through :class:`Reward`: one that raises, returns the wrong number or kind of
  rewards, or does not return within its ``timeout_s`` fails the run as a user error (:class:`RewardError`) naming
  it, the step and the example -- Ray Train's group restarts and the watchdog give up on it, nothing trained is
  lost (the checkpoints stay).
"""

from __future__ import annotations

import importlib
import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_jobs.data.tokenize import IGNORE_INDEX
from ray_jobs.errors import UserError

if TYPE_CHECKING:
    from ray_jobs.config.train import RewardFunction

REWARD_TIMEOUT_S = 120.0  # how long one call of a reward function may take before the run fails naming it


class RewardError(UserError, ValueError):
    """A reward function failed: its message names the function, the step and the example."""


def prompt_of(ids: np.ndarray, labels: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A staged row's prompt and its record's completion (the reward's ``answer``): the row is one example (padded
    by a run of positions from 0), its prompt the tokens before the first learned one."""
    restarts = np.flatnonzero(positions[1:] == 0)
    n = int(restarts[0]) + 1 if len(restarts) else len(ids)
    learned = np.flatnonzero(labels[:n] != IGNORE_INDEX)
    start = int(learned[0]) if len(learned) else n
    return ids[:start], ids[start:n]


def generation_batch(rows: tuple[np.ndarray, ...], tokenizer, generations: int) -> list[dict[str, Any]]:
    """A step's prompts as TRL's GRPO takes them: per row ``{prompt, answer, prompt_ids}``, ``generations`` times in
    a row (one prompt's group)."""
    out = []
    for ids, labels, positions in zip(*rows, strict=True):
        prompt, answer = prompt_of(ids, labels, positions)
        item = {
            "prompt": tokenizer.decode(prompt.tolist(), skip_special_tokens=True),
            "answer": tokenizer.decode(answer.tolist(), skip_special_tokens=True),
            "prompt_ids": prompt.tolist(),
        }
        out += [dict(item) for _ in range(generations)]
    return out


def load_reward(function: str):
    """The user's reward function named ``module:function``; a user error naming it when it cannot be had."""
    module, _, name = function.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise RewardError(f"train.rewards: {function}: cannot import {module}: {e}") from None
    except AttributeError:
        raise RewardError(f"train.rewards: {function}: {module} has no {name}") from None
    if not callable(fn):
        raise RewardError(f"train.rewards: {function}: not a function")
    return fn


class Reward:
    """One of ``train.rewards`` as TRL calls it: the user's function, checked (module docstring). ``step()`` says
    the step being trained (for the error's message)."""

    def __init__(self, spec: RewardFunction, step, timeout_s: float = REWARD_TIMEOUT_S):
        self.spec, self.fn, self.step, self.timeout_s = spec, load_reward(spec.function), step, timeout_s
        self.__name__ = spec.function.partition(":")[2]  # TRL's name for its metrics (``rewards/<name>/mean``)

    def __call__(self, prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
        done: dict[str, Any] = {}

        def call() -> None:
            try:
                done["out"] = self.fn(prompts=prompts, completions=completions, **kwargs)
            except Exception as e:
                done["error"] = e

        # a daemon thread: one that never returns must not keep the failed process from exiting
        thread = threading.Thread(target=call, name=f"reward-{self.__name__}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise self.error(f"did not return within {self.timeout_s:g}s", prompts, completions, 0)
        if "error" in done:
            e = done["error"]
            raise self.error(f"raised {type(e).__name__}: {e}", prompts, completions, 0) from e
        out = done["out"]
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            expected = f"expected a list of {len(completions)} (one per completion)"
            raise self.error(f"returned {got}; {expected}", prompts, completions, 0)
        for i, r in enumerate(out):
            if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r)):
                raise self.error(f"returned {r!r}: a reward is a number (or None)", prompts, completions, i)
        return [None if r is None else float(r) for r in out]

    def error(self, what: str, prompts: list[str], completions: list[str], i: int) -> RewardError:
        return RewardError(
            f"train.rewards: {self.spec.function} {what} at step {self.step()} "
            f"(example: prompt {prompts[i]!r}, completion {completions[i]!r})"
        )


def reward_functions(owner) -> list[Reward]:
    """``train.rewards`` as TRL's GRPOTrainer calls them (each checked: :class:`Reward`)."""
    step = lambda: owner.loop.step + 1  # noqa: E731 -- the step being trained when a reward is called
    return [Reward(r, step) for r in owner.cfg.train.rewards]


def grpo_args(owner, generations: int) -> dict[str, Any]:
    """GRPOConfig's batch fields from unbroken's: a micro-batch is ``micro_batch_size`` prompts, each sampled
    ``generations`` times; one sampling per optimizer step, each completion trained on once."""
    return {
        "per_device_train_batch_size": owner.cfg.train.micro_batch_size * generations,
        "steps_per_generation": owner.plan.micro_batches,
        "num_generations": generations,
        "num_iterations": 1,
        "reward_weights": [r.weight for r in owner.cfg.train.rewards],
        "shuffle_dataset": False,
    }


def staged_prompts(base: Any, owner) -> Any:
    """``base`` (TRL's GRPOTrainer) sampling from the staged prompt ids of each batch (module docstring); the
    completion tokens it samples are the step's tokens (``owner``'s count)."""

    class StagedPrompts(base):
        def _generate_and_score_completions(self, inputs):
            self.staged_ids = [x["prompt_ids"] for x in inputs]
            out = super()._generate_and_score_completions(inputs)
            owner.count_tokens(int(out["completion_mask"].sum()))
            return out

        def _tokenize_prompts(self, prompts):
            assert len(prompts) == len(self.staged_ids), "TRL tokenizes the batch it was handed"
            return self.staged_ids, None, {}

    return StagedPrompts
