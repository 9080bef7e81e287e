"""What crosses a layer or a process, as typed, versioned models: written and read through the same class, unknown
fields refused, older files migrated on read (``base.Record``). The run and series records (``control/records/``)
are built on the same base.

- ``job_spec.JobSpec``: what the control plane gives a training or search job (``<storage>/runs/<run>/
  job-spec-<n>.json``); ``job_spec.StageSpec``: what it gives a staging job.
- ``failure.JobFailure``: the root cause a failed job prints (its ``UNBROKEN_FAILURE`` line), which the watchdog's
  restart policy reads and the run record keeps on the incident.
- ``heartbeat.Beat``: what a job says of itself to watchers (``runs/<run>/heartbeat.json``).
- ``trials.Trials``: a search's trials as its driver last saw them (``runs/<search>/trials.json``).
- ``dataset.DatasetManifest``: a staged dataset (``datasets/<id>/manifest.json``), and ``job_spec.WorkerSpec``:
  what every rank of a training run is given (the manifests inside it, read once by the job's driver).
- ``tracking.TrackingLinks``: where each experiment tracker keeps the run (``runs/<run>/tracking.json``).
- ``checkpoint.CheckpointManifest``: what makes a checkpoint exist (``<checkpoint>/manifest.json``, written last).
  Beside it, its JSON files as TypedDicts: ``StateFile`` (``state.json``), ``RankPart`` (``rank-<r>.json``).
- ``metrics.MetricsRow``: one row of a run's metrics log (``runs/<run>/metrics.jsonl``): open columns, number values.
"""
