"""What ``unbroken check`` found: one line per thing looked at, each either a fact or a problem naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_jobs.errors import UserError


@dataclass(frozen=True)
class Finding:
    area: str  # config, model, data, cluster, storage, plan
    text: str
    problem: bool = False
    warning: bool = False


def ok(area: str, text: str) -> Finding:
    return Finding(area, text)


def problem(area: str, text: str) -> Finding:
    return Finding(area, text, problem=True)


def warning(area: str, text: str) -> Finding:
    return Finding(area, text, warning=True)


class RunRefused(UserError):
    """What ``check`` (and ``run``, first) found that stops the run; one problem a line."""

    def __init__(self, problems: list[Finding]) -> None:
        self.problems = problems
        super().__init__("\n".join(p.text if p.text.startswith(p.area) else f"{p.area}: {p.text}" for p in problems))


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    def add(self, found: list[Finding]) -> None:
        self.findings.extend(found)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.problem]

    def lines(self) -> list[str]:
        """A finding a block: its first line marked and its area named, the lines after it (a problem's file:line
        list) indented under its text."""
        mark = {(False, False): "ok     ", (True, False): "PROBLEM", (False, True): "warning"}
        width = max((len(f.area) for f in self.findings), default=0)
        indent = "\n" + " " * (len(mark[False, False]) + width + 3)
        return [
            f"{mark[f.problem, f.warning]} {f.area:<{width}}  {f.text.replace(chr(10), indent)}" for f in self.findings
        ]

    def refuse(self) -> None:
        if self.problems:
            raise RunRefused(self.problems)
