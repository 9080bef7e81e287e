"""Typed records on shared storage: the run record (``runs/<run>/run.json``) and the series record
(``series/<series>/series.json``). Pydantic models with a schema version; a file an older version wrote is migrated
when read, and an unknown field is refused like an unknown config key."""
