"""What the watchdog did, counted for Prometheus: incidents and restarts per run, and the runs it watches.

Counted in this process wherever the watchdog runs its passes (``check_run``; the flow sets the gauges of the pass);
served only where someone asks: ``unbroken watchdog --metrics-port P`` (:func:`serve`), its loop keeping one
process, so the counters add up over its passes. Counters start at 0 with the process, as Prometheus expects
(``increase()``/``rate()`` take a restart of the watchdog in their stride). Two watchdogs on one storage each count
what they did: only the one holding a run's lease restarts it, so the sum over watchdogs is the run's count.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from control.records.run import RunRecord

REGISTRY = CollectorRegistry()  # this module's series only (no process or GC collectors of the library's default)
INCIDENTS = Counter(
    "unbroken_watchdog_incidents",
    "incidents the watchdog recorded (acted on, noted or observed)",
    ["run", "kind"],
    registry=REGISTRY,
)
RESTARTS = Counter(
    "unbroken_watchdog_restarts", "restarts the watchdog performed (a new job attempt each)", ["run"], registry=REGISTRY
)
GAVE_UP = Counter(
    "unbroken_watchdog_gave_up", "runs the watchdog gave up on (marked failed)", ["run"], registry=REGISTRY
)
RESTART_FAILURES = Counter(
    "unbroken_watchdog_restart_failures",
    "restarts tried that could not complete (the old job's end unverifiable, the cluster not provisioned)",
    ["run"],
    registry=REGISTRY,
)
LEFT_ALONE = Counter(
    "unbroken_watchdog_left_alone",
    "passes that left a run alone, by why: unreadable (a record this "
    "release cannot read), elsewhere (a local head on another host), storage-unreachable, "
    "storage-full, lease-lost",
    ["run", "reason"],
    registry=REGISTRY,
)
LEFT_ALONE_REASONS = ("unreadable", "elsewhere", "storage-unreachable", "storage-full", "lease-lost")
RUNS = Gauge("unbroken_watchdog_runs_watched", "active runs at the last pass", registry=REGISTRY)
PASSES = Counter("unbroken_watchdog_passes", "watchdog passes over the storage", registry=REGISTRY)
LAST_PASS = Gauge(
    "unbroken_watchdog_last_pass_timestamp_seconds", "when the last pass ended (Unix time)", registry=REGISTRY
)


def decided(before: RunRecord, after: RunRecord) -> None:
    """Count the incidents a decision added to a run's record (``after``: the decided copy of ``before``; the log
    only grows)."""
    for incident in after.incidents[len(before.incidents) :]:
        INCIDENTS.labels(run=after.name, kind=incident.kind).inc()


def acted(run: str, action: str) -> None:
    """Count what carrying out a decision came to (an Outcome's ``action``)."""
    if action == "restarted":
        RESTARTS.labels(run=run).inc()
    elif action == "gave-up":
        GAVE_UP.labels(run=run).inc()
    elif action == "restart-failed":
        RESTART_FAILURES.labels(run=run).inc()
    elif action in LEFT_ALONE_REASONS:
        LEFT_ALONE.labels(run=run, reason=action).inc()


def passed(active: int) -> None:
    """A pass over the storage ended, with ``active`` runs to watch."""
    RUNS.set(active)
    PASSES.inc()
    LAST_PASS.set(time.time())


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve the counters at ``http://host:port/metrics`` from a daemon thread; the port bound (``port`` 0: a free
    one)."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return server.server_address[1]
