"""What every config section shares: unknown keys are errors, every field documented; one error for all problems."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ray_jobs.errors import UserError


class ConfigError(UserError, ValueError):
    """A config that cannot be used; the message lists every bad field, one per line."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid {source} ({len(problems)} problem(s)):\n{lines}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
