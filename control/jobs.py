"""Ray jobs through the Jobs API: submit, stop, and watch one to its end (status polling with one confirmation rule
for "the cluster is gone", control/confirm.py; log tail). The Prefect tasks that use these are in tasks/jobs.py."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import shlex
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from control import jobsapi
from control.backends.base import ClusterError, ClusterHandle, StopUnverified, jobs_client
from control.confirm import Suspicion
from control.jobcode import runtime_env
from control.joblog import LogForwarder, RunLogger
from control.logs import run_logger
from ray_jobs.config import Config
from ray_jobs.contracts.failure import JobFailure
from ray_jobs.contracts.job_spec import AttemptInputs, JobSpec
from ray_jobs.errors import UserError
from ray_jobs.poll import poll_until
from ray_jobs.secrets import MaskedError
from ray_jobs.storage import Layout, write_json_atomic

T = TypeVar("T")
OnPoll = Callable[[str], Coroutine[Any, Any, None]]  # the watch's hook, given the job's status each time

__all__ = [
    "ClusterLost",
    "JobFailed",
    "JobUserError",
    "StopUnverified",
    "run_to_end",
    "stop_and_wait",
    "submit",
    "watch",
]


class JobFailed(MaskedError, RuntimeError):
    """A Ray job ended in a state other than SUCCEEDED. Its message (a flow run's state) is masked, as ClusterError's."""


class JobUserError(UserError, JobFailed):
    """A job failed on the user's mistake (its root cause a ``UserError``): the message is that mistake, as the
    job's failure line named it."""


class ClusterLost(JobFailed):
    """The cluster stopped answering while a job ran on it (the job's fate is unknown)."""


AGENT_WAIT_S = 60.0  # how long a submission retries "No available agent to submit job" (a head still starting)
# The SDK's submission (the working dir's upload, then the POST) has no timeout of its own: this bounds it.
SUBMIT_TIMEOUT_S = 300.0
# Consecutive unanswered status polls that mean the cluster is gone, not a blip (besides confirm_s): the watch polls
# every STATUS_POLL_S, so more looks than the watchdog's, whose passes are minutes apart.
LOST_AFTER_ERRORS = 5


def stop_and_wait(address: str, submission_id: str, wait_s: float = 60.0) -> bool:
    """Stop a Ray job if the cluster still runs it and wait until Ray says it ended. False when there was nothing
    to stop (the cluster answers: no such job, or it already ended). StopUnverified when the cluster does not
    answer (the job may still run), ClusterError when it outlives ``wait_s``."""
    view = jobsapi.read_job(address, submission_id)
    if view.api == "unknown":
        raise StopUnverified(f"cannot tell whether Ray job {submission_id} still runs: {view.why}")
    if view.api == "missing" or view.terminal:
        return False
    jobsapi.stop_job(address, submission_id)
    last = [view]

    def ended() -> bool:
        last[0] = jobsapi.read_job(address, submission_id)
        return last[0].terminal or last[0].api == "missing"

    if not poll_until(ended, wait_s, every_s=0.5):
        view = last[0]
        raise ClusterError(f"Ray job {submission_id} did not stop within {wait_s:.0f}s ({view.status or view.why})")
    return True


def write_job_spec(cfg: Config, attempt: int, inputs: AttemptInputs, resume_from: str | None = None) -> str:
    """Everything attempt ``attempt``'s job needs, on shared storage where the cluster can read it: its config, what
    it is given (``inputs``) and the checkpoint it resumes from (None: the newest valid one, or a fresh start).
    Returns its URL."""
    url = Layout(cfg.storage).job_spec(cfg.name, attempt)
    spec = JobSpec(config=json.loads(cfg.model_dump_json()), inputs=inputs, resume_from=resume_from, attempt=attempt)
    write_json_atomic(url, spec.dump(full=True))  # every field, this version first
    return url


def submit(
    handle: ClusterHandle,
    submission_id: str,
    module: str,
    spec_url: str,
    env: dict[str, str] | None = None,
    flags: tuple[str, ...] = (),
    code: list[str] | None = None,
) -> str:
    """Submit ``python -m <module> --spec <url> [flags]`` (not twice under one id). ``env``: extra variables for
    its processes; ``flags``: ``--attach`` for a driver that re-attaches to its attempt's run host (ray_jobs/host.py);
    ``code``: the user's Python it imports (:func:`user_code`), shipped beside unbroken's."""
    log = run_logger()
    if _already_submitted(handle.address, submission_id):
        log.info("Ray job %s was already submitted; watching it", submission_id)
        return submission_id
    entrypoint = " ".join([shlex.quote(handle.python), "-m", module, "--spec", shlex.quote(spec_url), *flags])
    _submit_once_agent_is_up(handle.address, submission_id, entrypoint, runtime_env(submission_id, env, code or []))
    log.info("submitted Ray job %s (%s)", submission_id, module)
    return submission_id


def _submit_once_agent_is_up(address: str, submission_id: str, entrypoint: str, runtime_env: dict[str, Any]) -> None:
    """Submit the job, retrying while the head's job agent is not up yet (a head that just started)."""

    def job() -> None:  # a client per try: a head that just came up may not have answered the last one
        jobs_client(address).submit_job(
            entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env, entrypoint_num_cpus=0
        )

    last: list[Exception] = []

    def submitted() -> bool:
        try:
            _bounded(job, SUBMIT_TIMEOUT_S, "submitting a Ray job")
            return True
        except RuntimeError as e:  # a head that just started answers before its job agent is up
            if "No available agent" not in str(e):
                raise
            last[:] = [e]
            run_logger().info("the cluster's job agent is not up yet; retrying the submission")
            return False

    if not poll_until(submitted, AGENT_WAIT_S, every_s=1.0):
        raise last[0]


def _already_submitted(address: str, submission_id: str) -> bool:
    """Whether the cluster knows a job of this id (one read, with a timeout); ClusterError when it cannot tell."""
    view = jobsapi.read_job(address, submission_id)
    if view.api == "unknown":
        raise ClusterError(f"cannot tell whether Ray job {submission_id} was submitted already: {view.why}")
    return view.api == "ok"


def _bounded(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call()``, given up on after ``timeout_s`` (ClusterError). For the Jobs SDK's submission, whose requests
    have no timeout: it is kept rather than redone by hand because it packages and uploads the working dir first
    (gitignore rules, content-hashed package URIs, the runtime_env's validation), which a copy would have to track
    across Ray versions. A call given up on is left to end in its thread."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="jobs-sdk")
    try:
        return pool.submit(call).result(timeout=timeout_s)
    except FutureTimeout:
        raise ClusterError(f"{what}: no answer within {timeout_s:g}s") from None
    finally:
        pool.shutdown(wait=False)


WARN_EVERY_S = 60.0  # a persisting plumbing error is logged once a minute, not once a poll


def cancelled(e: BaseException) -> bool:
    """A cancel or termination of the flow run (the user's wish to stop), as opposed to an error in it."""
    return isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)) or "Termination" in type(e).__name__


# How often a watch reads its job's status (one small GET): the end of a job is noticed within this. Progress
# artifacts and the registry (``on_poll``) are updated every ``poll_s`` (every so many status reads).
STATUS_POLL_S = 0.5
DRIVER_CHECK_S = 10.0  # a hosted run's driver looked for among the cluster's nodes (watch's driver_gone)


@dataclass(frozen=True)
class Judgement:
    """What one status poll means for the flow's watch, given the polls before it (pure: ``judge``)."""

    suspicion: Suspicion | None  # the open suspicion after this poll (None: the Jobs API answered)
    lost: bool = False  # the silence is confirmed: the cluster is taken for gone
    healed_after_s: float | None = None  # the Jobs API answers again after this long
    held_s: float = 0.0  # how long the silence has held (when it has not healed)


def judge(view: jobsapi.JobView, suspicion: Suspicion | None, confirm_s: float, now: float) -> Judgement:
    """The flow's watch decides like the watchdog (control/confirm.py): a poll that told nothing about the job is a
    blip until it held for ``confirm_s`` over at least LOST_AFTER_ERRORS polls (a 502, a restarting dashboard)."""
    if view.api == "ok":
        return Judgement(None, healed_after_s=suspicion.held_s(now) if suspicion else None)
    seen = Suspicion(suspicion.first_at if suspicion else now, (suspicion.observations if suspicion else 0) + 1)
    return Judgement(seen, seen.held(now, confirm_s, LOST_AFTER_ERRORS), held_s=seen.held_s(now))


class _Watch:
    """The state of one watch: the open suspicion (consecutive unanswered polls), rate-limited plumbing warnings."""

    def __init__(self, address: str, submission_id: str, confirm_s: float, log: RunLogger) -> None:
        self.address, self.sid, self.confirm_s, self.log = address, submission_id, confirm_s, log
        self.unanswered: Suspicion | None = None
        self.warned_at: dict[str, float] = {}

    def observe(self, view: jobsapi.JobView) -> None:
        """Judge one poll and act on it: log a healed silence, warn of an open one, ClusterLost once confirmed."""
        j = judge(view, self.unanswered, self.confirm_s, time.monotonic())
        self.unanswered = j.suspicion
        if j.healed_after_s is not None:
            self.log.info("the Jobs API answers again after %.0fs", j.healed_after_s)
        if j.suspicion is None:
            return
        self.warn(
            "poll", f"Ray job {self.sid}: {view.why} (for {j.held_s:.0f}s; not acted on before {self.confirm_s:g}s)"
        )
        if j.lost:
            what = "has no record of" if view.api == "missing" else "stopped answering about"
            raise ClusterLost(
                f"the Ray cluster at {self.address} {what} job {self.sid} for {j.held_s:.0f}s: {view.why}"
            )

    async def judged(self, view: jobsapi.JobView, alive: Callable[[], str | None] | None) -> None:
        """``observe``, with a confirmed silence put to the other channel first: while ``alive()`` says the job
        trains on, the cluster is not taken for lost (the silence is judged afresh)."""
        try:
            self.observe(view)
        except ClusterLost:
            why = await asyncio.to_thread(alive) if alive is not None else None
            if why is None:
                raise
            self.warn(
                "veto",
                f"Ray job {self.sid}: the Jobs API at {self.address} does not answer, but {why}: not "
                "taken for lost; still watching",
            )
            self.unanswered = None

    def warn(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self.warned_at.get(key, -WARN_EVERY_S) >= WARN_EVERY_S:
            self.warned_at[key] = now
            self.log.warning(message)


async def watch(
    handle: ClusterHandle,
    submission_id: str,
    poll_s: float = 2.0,
    on_poll: OnPoll | None = None,
    confirm_s: float = 30.0,
    alive: Callable[[], str | None] | None = None,
    driver_gone: Callable[[jobsapi.JobView], bool] | None = None,
) -> str:
    """Poll the job until it ends, forwarding its log. Errors of the watch's own plumbing (``on_poll``: progress
    artifacts, the registry) are logged and retried, never fatal to the job; an unanswered poll is a blip until it
    held for ``confirm_s`` -- and even then the cluster is not taken for lost while ``alive()`` (the job's heartbeat
    on storage, another channel) says the job trains on: the watch keeps waiting. Only a cancel of the flow run stops
    the job: if the flow itself fails, the job trains on and the watchdog adopts it. ``driver_gone(view)``, asked of
    a running job every DRIVER_CHECK_S: its driver is dead though the Jobs API says RUNNING (a head restarted under
    GCS fault tolerance) -- the watch ends as for a failed job, for its caller to re-attach a driver."""
    log = run_logger()
    state = _Watch(handle.address, submission_id, confirm_s, log)
    logs = LogForwarder(handle.address, submission_id, log)
    tail = asyncio.create_task(logs.follow())
    try:
        view = await _poll_to_end(handle.address, submission_id, state, poll_s, on_poll, alive, driver_gone)
        await logs.finish(tail)
    except BaseException as e:
        if cancelled(e):
            _stop_for_cancel(handle.address, submission_id, log)
        raise
    finally:
        tail.cancel()
    if view.status != "SUCCEEDED":
        # the root cause's line (ray_jobs.job), from the whole log: the message's tail may end in the workers' lines
        failure = JobFailure.last_in(jobsapi.job_logs(handle.address, submission_id) or view.message)
        if failure is not None and failure.user:  # the input's mistake: said as itself, not as the job's logs
            raise JobUserError(f"{failure.message} (Ray job {submission_id} failed on it; its checkpoints are kept)")
        raise JobFailed(f"Ray job {submission_id} ended {view.status}: {view.message}")
    return view.status


async def _poll_to_end(
    address: str,
    submission_id: str,
    state: _Watch,
    poll_s: float,
    on_poll: OnPoll | None,
    alive: Callable[[], str | None] | None,
    driver_gone: Callable[[jobsapi.JobView], bool] | None = None,
) -> jobsapi.JobView:
    """The watch's status polls, every STATUS_POLL_S, until the job ended (its last view); ``on_poll`` every
    ``poll_s`` and on the end, its errors warned of and retried; ``driver_gone`` every DRIVER_CHECK_S."""
    polls, every = 0, max(1, round(poll_s / STATUS_POLL_S))
    checks = max(1, round(DRIVER_CHECK_S / STATUS_POLL_S))
    while True:
        view = await asyncio.to_thread(jobsapi.read_job, address, submission_id)
        await state.judged(view, alive)
        polls += 1
        gone = driver_gone if view.status == "RUNNING" and (polls - 1) % checks == 0 else None
        if gone is not None and await asyncio.to_thread(gone, view):
            return replace(view, status="FAILED", message="its driver's node is dead (a head restarted without it)")
        if view.api == "ok" and on_poll is not None and (view.terminal or (polls - 1) % every == 0):
            try:
                await on_poll(view.status)
            except Exception as e:  # plumbing: retried next poll
                state.warn("on_poll", f"watch: {type(e).__name__}: {e} (training goes on; retried)")
        if view.terminal:
            return view
        await asyncio.sleep(STATUS_POLL_S)


def run_to_end(
    handle: ClusterHandle,
    submission_id: str,
    poll_s: float = 1.0,
    confirm_s: float = 30.0,
    on_poll: OnPoll | None = None,
) -> str:
    """Wait from sync code (a sync task) for a submitted job to end: :func:`watch` itself -- the same status polls,
    confirmation rule, log forwarding, ``on_poll`` hook and stop on cancel -- on an event loop of its own. Its final
    status, or JobFailed."""
    main = watch(handle, submission_id, poll_s, on_poll=on_poll, confirm_s=confirm_s)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main)
    return _run_beside(main)  # a sync task called from an async flow: this thread's loop is the flow's


def _run_beside(main: Coroutine[Any, Any, str]) -> str:
    """``asyncio.run(main)`` in a helper thread, waited on here, in this thread's context (the task run's: its logger,
    its artifacts). A cancel that reaches this thread (the flow run's termination) is passed on to ``main``, and
    waited for: a watch stops its job on a cancel."""
    started: Future[tuple[asyncio.AbstractEventLoop, asyncio.Task[str]]] = Future()

    async def runner() -> str:
        task = asyncio.current_task()
        assert task is not None, "runner is asyncio.run's main task"
        started.set_result((asyncio.get_running_loop(), task))
        return await main

    def in_thread() -> str:
        return asyncio.run(runner())

    context = contextvars.copy_context()  # copied in this thread: its context is what the helper thread runs in
    with ThreadPoolExecutor(1, thread_name_prefix="watch") as pool:
        done = pool.submit(lambda: context.run(in_thread))
        try:
            return done.result()
        except BaseException:
            if not done.done():
                loop, task = started.result()
                loop.call_soon_threadsafe(task.cancel)
                with contextlib.suppress(BaseException):
                    done.result()
            raise


def _stop_for_cancel(address: str, submission_id: str, log: RunLogger) -> None:
    try:
        if stop_and_wait(address, submission_id, wait_s=30):
            log.warning("flow run cancelled: stopped Ray job %s", submission_id)
    except Exception as e:
        log.warning("flow run cancelled; could not stop Ray job %s: %s", submission_id, e)
