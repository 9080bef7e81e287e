"""A hyperparameter search on the cluster: Ray Tune runs each trial as a Ray Train run of the project's own trainer.

``trials`` (which trials, from the config alone), ``scheduler`` (ASHA whose rungs survive a restored experiment),
``progress`` (the trials' states on storage, and the search's heartbeat) and ``driver`` (the Tuner, built or
restored); the Ray job entrypoint is ``ray_jobs/search_job.py``.
"""
