"""Ray Jobs entrypoint that stages a dataset on the cluster: ``python -m ray_jobs.stage_job --spec <url>``.

The same staging code as a local staging (``ray_jobs.data.staging.stage``), run from this driver with ``on="cluster"``:
new source files are hashed by one Ray task each, and their pieces are read and tokenized by Ray actors spread over
every node, so the work grows with the cluster instead of with one machine. Packing and the spill stay here, on the
node that runs the driver (its ``data.work_dir``), which is also where a killed staging resumes from.

While it reads, a progress line goes to the job's log every few seconds (source bytes read, records, MB/s, tokens/s,
ETA) and the same progress, as JSON, to the spec's ``progress_url``, which the flow polls into its progress artifact.
How it ended goes to the spec's ``outcome_url`` (the dataset id and manifest, or the error and whether it was the
data's fault), which the flow reads: a bad record fails the flow with the same ``file:line: reason`` as a local
staging would.
"""

from __future__ import annotations

import logging
import sys

from ray_jobs.config import job_spec
from ray_jobs.contracts.job_spec import StageSpec
from ray_jobs.data.sources import SourceUnreadable, StagingError
from ray_jobs.data.staging import stage
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.progress import Reporter, Snapshot, then
from ray_jobs.secrets import mask_output
from ray_jobs.storage import write_json_atomic

log = logging.getLogger("unbroken.stage_job")


def main(argv: list[str] | None = None) -> int:
    import ray

    mask_output()  # the job's log never shows a credential (a source URL's)
    spec, cfg = job_spec("ray_jobs.stage_job", StageSpec, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ray.init()
    try:
        tokenizer = load_tokenizer(spec.model_path, cfg.data.cache_dir)
        progress = _reporter(spec)
        writing = Reporter("writing shards", unit="rows", log=log, quiet_s=5.0, tty=False)
        result = stage(
            cfg.data,
            tokenizer,
            spec.model_path,
            cfg.storage,
            on="cluster",
            progress=progress.update,
            writing=then(progress, writing),
        )
        progress.finish()
        writing.finish()
    except StagingError as e:
        write_json_atomic(spec.outcome_url, {"error": str(e), "unreadable": isinstance(e, SourceUnreadable)})
        print(f"STAGING FAILED: {e}", flush=True)
        return 2
    outcome = {
        "dataset_id": result.dataset_id,
        "manifest_url": result.manifest_url,
        "cache_hit": result.cache_hit,
        "sources_read": result.sources_read,
    }
    write_json_atomic(spec.outcome_url, outcome)
    log.info("staged %s on the cluster (%s)", result.dataset_id, "cache hit" if result.cache_hit else "new")
    return 0


def _reporter(spec: StageSpec) -> Reporter:
    """Progress lines into the job's log, each also written to ``progress_url`` (for the flow's artifact)."""
    url = spec.progress_url

    def write(snap: Snapshot) -> None:
        if url:
            write_json_atomic(url, snap.to_json())

    return Reporter("staging", log=log, rates=("tokens",), on_update=write, tty=False)


if __name__ == "__main__":
    sys.exit(main())
