"""How flows are served and deployed (schedules, event triggers, concurrency, prefect.yaml).

The layer above ``flows/`` (dependency direction: deployments -> flows -> tasks -> ray_jobs). Until deployments
land, flows run directly through the ``unbroken`` CLI against an ephemeral Prefect server.
"""
