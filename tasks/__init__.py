"""Prefect tasks: small typed verbs, one side effect each (stage, provision, submit, watch, ...)."""
