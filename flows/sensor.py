"""The dataset sensor: fingerprint a source location; when it changes, emit ``unbroken.dataset.updated``.

A scheduled deployment runs it (see deployments/serve.py); the finetune deployment's trigger turns the event into a
retraining run with the event's ``dataset_uri``. So a new file landing in the bucket retrains without anyone
clicking.

The fingerprint is the sorted list of the source's data files (the files staging would read) with their size and
ETag/modification time: cheap on a bucket of any size (one listing, no reads). The last fingerprint seen is kept on
storage (``<storage>/sensors/<source-hash>.json``), so the sensor can run anywhere and any number of times; the
first look at a location records it without an event.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TypedDict

from prefect import flow
from prefect.events import emit_event

from control.logs import run_logger
from ray_jobs.config import absolute_url
from ray_jobs.data.staging import list_sources
from ray_jobs.secrets import mask, reveal
from ray_jobs.storage import file_version, fs_and_path, join, read_json, write_json_atomic

EVENT = "unbroken.dataset.updated"


class SourceFile(TypedDict):
    file: str  # its URL, masked
    size: int | None
    version: str  # the store's change marker (ray_jobs/storage.file_version)


class Look(TypedDict):
    """What a source held at one look (the sensor's state file keeps the last, with ``seen_at``)."""

    source: str
    fingerprint: str  # over every file's name, size and version
    files: list[SourceFile]


class SensorResult(TypedDict):
    """What a sensor flow run returns: what it saw, and whether it emitted an event."""

    source: str
    fingerprint: str
    changed: bool
    first_look: bool


def fingerprint(source: str) -> Look:
    """What the source holds now: each data file with size and version marker, and a hash over all of them."""
    files: list[SourceFile] = []
    for url in list_sources(source, "source"):
        fs, path = fs_and_path(url)
        info = fs.info(path)
        # masked: the state file and the event show it (a change of password is no change of data)
        files.append({"file": mask(url, ()), "size": info.get("size"), "version": file_version(info)})
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    return {"source": source, "fingerprint": digest, "files": files}


def _key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def resource_id(source: str) -> str:
    return f"unbroken.dataset.{_key(source)}"


def state_url(storage: str, source: str) -> str:
    return join(storage, "sensors", f"{_key(source)}.json")


@flow(name="dataset-sensor", flow_run_name="dataset-sensor")
def dataset_sensor(source: str, storage: str = ".unbroken/storage") -> SensorResult:
    """Look at ``source``; emit ``unbroken.dataset.updated`` (payload: ``dataset_uri``) if it changed since the
    last look. Returns what was seen and whether an event went out."""
    log = run_logger()
    # a served sensor's source parameter is masked (deployments/serve.py): revealed from UNBROKEN_CREDENTIALS to be
    # read, masked again wherever it is shown (the event's payload names it; the finetune flow reveals it the same way)
    source, storage = reveal(absolute_url(source)), absolute_url(storage)
    now = fingerprint(source)
    url = state_url(storage, source)
    try:
        before = read_json(url)
    except FileNotFoundError:
        before = None
    changed = before is not None and before["fingerprint"] != now["fingerprint"]
    if changed:
        _announce(source, before, now, log)
    elif before is None:
        log.info(
            "first look at %s: %d file(s), fingerprint %s (recorded; no event)",
            source,
            len(now["files"]),
            now["fingerprint"],
        )
    else:
        log.info("%s unchanged (%s)", source, now["fingerprint"])
    if before is None or changed:
        write_json_atomic(url, {**now, "seen_at": time.time()})
    return {"source": source, "fingerprint": now["fingerprint"], "changed": changed, "first_look": before is None}


def _announce(source: str, before: Look, now: Look, log: logging.Logger | logging.LoggerAdapter) -> None:
    """Emit ``unbroken.dataset.updated`` for a source that changed from ``before`` to ``now``, and log it."""
    added = sorted({f["file"] for f in now["files"]} - {f["file"] for f in before["files"]})
    emit_event(
        event=EVENT,
        resource={"prefect.resource.id": resource_id(source), "prefect.resource.name": mask(source, ())},
        payload={
            "dataset_uri": mask(source, ()),
            "fingerprint": now["fingerprint"],
            "previous": before["fingerprint"],
            "files": len(now["files"]),
            "added": added[:50],
        },
    )
    log.info(
        "%s changed (%s -> %s, %d new file(s)): emitted %s",
        source,
        before["fingerprint"],
        now["fingerprint"],
        len(added),
        EVENT,
    )
