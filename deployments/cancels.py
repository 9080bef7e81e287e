"""A cancel asked of a served run is carried out however long the Prefect server was away.

``unbroken serve`` is Prefect's own runner (``prefect.serve``). It learns that a flow run is Cancelling from the
server's events websocket and, when that fails, by polling -- and it gives both up for good: the websocket after ten
quick reconnects (~10 s), the polling after three failed polls in a row (~6 s more), after which Prefect logs
"flow run cancellation will fail" and a cancel from the UI is never carried out while its Ray job trains on. A
websocket closed cleanly by a stopping server ends the observation silently. So a server restart (an upgrade, a
crash) that keeps the API away for ~16 s left every served run uncancellable until ``unbroken serve`` was restarted
(measured here: a 26 s outage does it; CI's loaded machine hit it on its 15 s restart).

:class:`LastingCancellingObserver` is Prefect's observer with one change: when the websocket ends, for whatever
reason, it polls with Prefect's own check (``_check_for_cancelled_flow_runs``) every ``polling_interval`` for as
long as the runner runs, and a failed poll is retried, not counted towards giving up. Prefect offers no setting for
this (the reconnect count and the polling's error threshold are fixed in its code), so :func:`install` puts the
class where the runner looks it up. Written against prefect 3.8.8; :func:`install` refuses a Prefect whose runner no
longer has the name, so an upgrade that moves it fails at ``unbroken serve``'s start rather than silently.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prefect._internal.observers import FlowRunCancellingObserver

log = logging.getLogger("unbroken.serve")
WARN_EVERY_S = 60.0  # a poll failing on and on (the server is away) is logged once a minute


class LastingCancellingObserver(FlowRunCancellingObserver):
    """Prefect's cancel observer whose polling fallback starts whenever the events websocket ends and never gives
    up (see the module's doc)."""

    def _start_polling_task(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._is_shutting_down:  # the runner is stopping
            return
        exc = task.exception()
        log.warning(
            "the Prefect events stream ended (%s); polling for cancelled flow runs every %gs",
            exc or "closed by the server",
            self.polling_interval,
        )
        self._polling_task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        failing_since: float | None = None
        warned_at = 0.0
        while not self._is_shutting_down:
            try:
                await self._check_for_cancelled_flow_runs()
            except Exception as e:  # the server is away (or restarting): try again next interval, for ever
                now = time.monotonic()
                failing_since = failing_since or now
                if now - warned_at >= WARN_EVERY_S:
                    warned_at = now
                    log.warning(
                        "cannot poll the Prefect API for cancelled flow runs (for %.0fs): %s", now - failing_since, e
                    )
            else:
                if failing_since is not None:
                    log.warning(
                        "polling for cancelled flow runs works again after %.0fs", time.monotonic() - failing_since
                    )
                failing_since, warned_at = None, 0.0
            await asyncio.sleep(self.polling_interval)


def install() -> None:
    """Make Prefect's runner (the one ``prefect.serve`` starts) observe cancels with :class:`LastingCancellingObserver`."""
    import prefect.runner.runner as runner

    if getattr(runner, "FlowRunCancellingObserver", None) not in (FlowRunCancellingObserver, LastingCancellingObserver):
        raise RuntimeError(
            "this Prefect's runner no longer looks up FlowRunCancellingObserver: "
            "deployments/cancels.py must be brought up to date"
        )
    runner.FlowRunCancellingObserver = LastingCancellingObserver  # ty: ignore[invalid-assignment]  (a subclass, by design)
