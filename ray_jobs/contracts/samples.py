"""``runs/<run>/samples.json``: held-out prompts answered by the base model and the fine-tuned one, written by the
training job right after it exported the final model (ray_jobs/train/samples.py) and published by the flow's
summarize task -- which then loads no model and generates nothing itself."""

from __future__ import annotations

from typing import ClassVar

from typing_extensions import TypedDict  # pydantic validates a TypedDict field only from typing_extensions on 3.11

from ray_jobs.contracts.base import Record


class Sample(TypedDict):
    """A held-out prompt answered by the base model and the fine-tuned one."""

    prompt: str  # as a person reads it (the question, not the rendered template)
    target: str
    before: str  # the base model's answer
    output: str  # the fine-tuned model's
    exact: bool  # output == target up to surrounding whitespace


class Samples(Record):
    """What the job generated: empty when ``train.sample_generations`` is 0 or the records have no expected answer
    (``data.format: text``)."""

    SCHEMA: ClassVar[int] = 1
    base_model: str  # the weights the run started from (the base, or a warm start's folder)
    final_model: str
    samples: list[Sample] = []
