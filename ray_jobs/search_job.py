"""Ray Jobs entrypoint for a hyperparameter search: ``python -m ray_jobs.search_job --spec <url of job spec json>``.

The spec is a training job's (written by the tune flow, or by the watchdog when it resubmits the search): the
config with its ``tune`` section, the dataset manifest, the base model, the series' eval set. Every trial trains
with the manifest and base model given here. Submitted again after the driver or the cluster was lost, it restores
the experiment from storage (ray_jobs/search/driver.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from ray_jobs.config import job_spec
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.job_spec import JobSpec
from ray_jobs.job import POLL_INTERVAL_ENV, POLL_INTERVAL_S, loop_config, root_cause
from ray_jobs.secrets import mask_output

log = logging.getLogger("unbroken.search")


def main(argv: list[str] | None = None) -> int:
    import ray

    from ray_jobs.contracts.trials import DONE
    from ray_jobs.search.driver import build_tuner
    from ray_jobs.search.progress import SearchHeartbeat
    from ray_jobs.search.trials import trial_states
    from ray_jobs.search.trials import trials as search_trials

    mask_output()  # the job's log never shows a credential (ray_jobs/secrets.py)
    spec, cfg = job_spec("ray_jobs.search_job", JobSpec, argv)
    os.environ.setdefault(POLL_INTERVAL_ENV, POLL_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    trials = search_trials(cfg)
    base = loop_config(spec, cfg)  # the manifests read once, here
    loops = [base.model_copy(update={"config": t.config.model_dump_json()}) for t in trials]
    ray.init(ignore_reinit_error=True)
    with SearchHeartbeat(cfg, trials, spec.attempt):
        grid = build_tuner(cfg, trials, loops, ray.cluster_resources().get("CPU", 0.0)).fit()
    states = {name: t.state for name, t in trial_states(cfg.storage, cfg.name).items()}
    print("UNBROKEN_RESULT " + json.dumps({"trials": states}), flush=True)
    if any(state not in DONE for state in states.values()) or all(s == "failed" for s in states.values()):
        errors = [r.error for r in grid if r.error is not None]
        cause = root_cause(errors[0]) if errors else JobFailure(type="SearchIncomplete", message=f"trials: {states}")
        print(cause.line(), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
