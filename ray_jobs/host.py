"""The run host: what trains outlives the job's driver.

Ray Train v2's driver owns everything it starts: its ``TrainController`` is a plain actor the driver creates, the
controller owns the workers, and the training function is put by the driver -- so a driver's death ends the run, and
Ray Jobs never restarts a driver. With ``fault_tolerance.run_host`` the driver instead starts (or finds, by name) one
detached, named actor per attempt, :class:`RunHost`, which calls ``TorchTrainer.fit()``: the controller, the workers
and the training function are the host's, and the driver is a thin client that waits on it and relays its end (the
``UNBROKEN_RESULT`` / ``UNBROKEN_FAILURE`` line the control plane reads). A driver killed mid-run leaves the training
stepping; a new driver for the same attempt (``--attach``) finds the host by its name and waits on it in turn.

Never two hosts for one attempt: the name is the attempt's job spec's (one per attempt), and a driver gets the host
of that name if it exists (``get_if_exists``). A host ends itself: once its run ended and a driver took the outcome,
or when no driver has waited on it for ``fault_tolerance.run_host_orphan_s`` (nobody left to relay its end: it
stops, and its workers with it). A stopped job's driver (SIGTERM from the Jobs API: a cancel, ``unbroken stop``, the
watchdog giving up) kills its host first; where that driver is already gone, the control plane stops the host by
name (``python -m ray_jobs.job --spec <url> --stop-host``, control/runhost.py). Placement: beside its driver, so
a worker node's loss stays Ray Train's to recover; under GCS fault tolerance (``cluster.gcs_ft``) on a worker node,
so a head that goes away does not take it along (:func:`placement`).

Written by hand: Ray has no detached owner for a Ray Train run (Ray's own answer to a lost driver is a resubmission
that restores from storage, which is the watchdog's restart)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

Outcome = dict[str, Any]  # {"result": {metrics, checkpoint}} or {"failure": <UNBROKEN_FAILURE line>}

log = logging.getLogger("unbroken.host")

NAMESPACE = "unbroken"  # a job's default namespace is its own: a second driver finds the host in a fixed one
WAIT_S = 2.0  # a driver's wait on its host, one call at a time: how often the host hears its driver is there
STOP_WAIT_S = 30.0  # a stopped host's name freed (Ray deregisters a dead actor's name)
STOP_LINE = "UNBROKEN_HOST_STOP"  # what ``--stop-host`` printed: ``stopped`` or ``none``


def host_name(spec_url: str) -> str:
    """The host's actor name: its attempt's job spec's URL (one per attempt and storage), hashed."""
    return "unbroken-host-" + hashlib.sha256(spec_url.encode()).hexdigest()[:16]


class RunHost:
    """One attempt's training, run by a detached actor (module docstring). ``outcome``: None while it trains, then
    ``{"result": {...}}`` or ``{"failure": "<UNBROKEN_FAILURE line>"}``."""

    def __init__(self, train: Callable[[list[str]], Outcome], argv: list[str], orphan_s: float) -> None:
        self.train, self.argv, self.orphan_s = train, argv, orphan_s
        self.outcome: Outcome | None = None
        self.ended = threading.Event()
        self.seen = time.monotonic()  # the last time a driver waited on this host
        threading.Thread(target=self._train, name="unbroken-run-host", daemon=True).start()
        threading.Thread(target=self._reap, name="unbroken-host-reaper", daemon=True).start()

    def wait(self, timeout_s: float) -> Outcome | None:
        """The run's outcome once it ended, else None after ``timeout_s``; each call tells the host a driver is
        there."""
        self.seen = time.monotonic()
        self.ended.wait(timeout_s)
        self.seen = time.monotonic()
        return self.outcome

    def _train(self) -> None:
        try:
            self.outcome = self.train(self.argv)
        except BaseException as e:  # a bug of the host itself: said, never a silent end
            log.exception("the run host failed")
            self.outcome = {"failure": f"the run host failed: {type(e).__name__}: {e}"}
        finally:
            self.ended.set()

    def _reap(self) -> None:
        """End this host when no driver has waited on it for ``orphan_s`` (nobody is left to relay its end; the
        watchdog re-attaches a driver well within that when it looks after the run)."""
        while True:
            time.sleep(min(1.0, self.orphan_s / 4))
            if time.monotonic() - self.seen > self.orphan_s:
                state = "its outcome untaken" if self.ended.is_set() else "while it trained"
                log.warning("no driver waited on this run host for %.0f s (%s): it ends", self.orphan_s, state)
                os._exit(1)  # the controller and the workers are this actor's: they end with it


def placement(off_head: bool) -> Any:
    """Where the host goes. Beside its driver (this node: the head, where Ray Jobs runs drivers), so a worker node's
    loss never takes the host -- nor Ray Train's controller, which Ray places on the host's node -- with it; with
    ``off_head`` (the head may go away under GCS fault tolerance) on a live worker node, soft (the head when none is
    alive), where the loss of that one node is a lost attempt: the watchdog's restart."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    if not off_head:  # (the node table asked of the GCS only where it decides something)
        return NodeAffinitySchedulingStrategy(here, soft=True)
    workers = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" not in n["Resources"]]
    return NodeAffinitySchedulingStrategy(workers[0]["NodeID"] if workers else here, soft=True)


def host_for(
    spec_url: str,
    train: Callable[[list[str]], Outcome],
    argv: list[str],
    orphan_s: float,
    attach: bool,
    off_head: bool = False,
) -> Any:
    """This attempt's host: the one named for its job spec, started now unless ``attach`` (a driver re-attached to
    a run whose host must already be there: None when it is gone)."""
    import ray

    name = host_name(spec_url)
    if attach:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
    actor = ray.remote(RunHost).options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=4,  # a wait while another driver's wait (a re-attach) or a check is in flight
        num_cpus=0,
        max_restarts=0,  # a host that died is a lost attempt: the watchdog's restart, never a second host
        scheduling_strategy=placement(off_head),
    )
    return actor.remote(train, argv, orphan_s)


def drive(
    spec_url: str,
    train: Callable[[list[str]], Outcome],
    argv: list[str],
    orphan_s: float,
    attach: bool,
    off_head: bool = False,
) -> Outcome:
    """The driver's part: start or find the attempt's host (``train(argv)`` is what it runs), wait on it, and return
    its outcome; a stopped job stops its host first."""
    import ray
    from ray.exceptions import RayActorError

    if not ray.is_initialized():  # the job's cluster (RAY_ADDRESS, set by Ray Jobs)
        ray.init()
    host = host_for(spec_url, train, argv, orphan_s, attach, off_head)
    if host is None:
        return {"failure": failure("RunHostGone", "no run host for this attempt: its run ended, or its host died")}

    def stopped(signum: int, frame: object) -> None:  # a cancel, ``unbroken stop``, the watchdog giving up
        log.warning("the job was stopped: stopping its run host")
        ray.kill(host)
        sys.exit(1)

    signal.signal(signal.SIGTERM, stopped)
    try:
        while (outcome := ray.get(host.wait.remote(WAIT_S))) is None:
            pass
    except RayActorError as e:  # its node lost, or it ended orphaned: a lost attempt, the watchdog's restart
        return {"failure": failure("RunHostLost", f"the run host died: {str(e).splitlines()[0]}")}
    ray.kill(host)  # its outcome taken: the host's work is done
    return outcome


def stop(spec_url: str, wait_s: float = STOP_WAIT_S) -> str:
    """Kill the attempt's run host if it lives -- its controller and workers are its own and go with it -- and wait
    until its name is free (a dead actor's is); what was done: ``stopped`` or ``none``."""
    import ray

    if not ray.is_initialized():  # the job's cluster (RAY_ADDRESS, set by Ray Jobs)
        ray.init()
    name = host_name(spec_url)

    def found() -> Any:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None

    host = found()
    if host is None:
        return "none"
    ray.kill(host, no_restart=True)
    deadline = time.monotonic() + wait_s
    while found() is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run host {name} was killed but is still listed after {wait_s:.0f}s")
        time.sleep(0.2)
    log.warning("stopped run host %s", name)
    return "stopped"


def failure(kind: str, message: str) -> str:
    """An ``UNBROKEN_FAILURE`` line of the host's own."""
    from ray_jobs.contracts.failure import JobFailure

    return JobFailure(type=kind, message=message, kinds=[kind]).line()
