"""Prefect flows: orchestration only. Each stage is a task in ``tasks/``; heavy imports stay out of here."""

import tasks  # noqa: F401  (routes the control plane's logs into the flow runs' logs: tasks/__init__.py)
