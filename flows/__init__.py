"""Prefect flows: orchestration only. Each stage is a task in ``tasks/``; heavy imports stay out of here."""
