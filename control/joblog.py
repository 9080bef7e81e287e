"""A Ray job's log forwarded into the flow's log while the flow watches the job (control/jobs.py: ``watch``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from control import jobsapi
from control.backends.base import jobs_client
from control.logs import RELAYED

RunLogger = logging.Logger | logging.LoggerAdapter  # control/logs.run_logger's

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
TAIL_RETRY_S = 2.0


class LogForwarder:
    """The job's log into the flow's log: followed while it is written (Ray's log stream; a broken stream -- a
    proxy's reset, a restarting dashboard -- is re-opened, skipping the lines already forwarded), and once the job
    ended, completed from one read of the whole log: the stream delivers its last lines ~2-3 s after the end."""

    def __init__(self, address: str, submission_id: str, log: RunLogger) -> None:
        self.address, self.sid, self.log = address, submission_id, log
        self.forwarded = 0  # lines of the job's log forwarded so far

    def _forward(self, lines: list[str], first: int) -> None:
        """``lines`` are the job's log lines ``first``, ``first + 1``, ...: forward those not forwarded yet."""
        for n, line in enumerate(lines, first + 1):
            if n > self.forwarded and line.strip():
                self.log.info("[ray] %s", line.rstrip(), extra={RELAYED: True})
        self.forwarded = max(self.forwarded, first + len(lines))

    async def follow(self) -> None:
        while True:
            try:
                client = await asyncio.wait_for(asyncio.to_thread(jobs_client, self.address), jobsapi.TIMEOUT_S)
                seen = 0
                async for chunk in client.tail_job_logs(self.sid):
                    lines = _ANSI.sub("", chunk).splitlines()
                    self._forward(lines, seen)
                    seen += len(lines)
                return
            except Exception:  # the log is a convenience: never fatal, retried
                await asyncio.sleep(TAIL_RETRY_S)

    async def finish(self, follower: asyncio.Task) -> None:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        text = await asyncio.to_thread(jobsapi.job_logs, self.address, self.sid)
        if text is not None:
            self._forward(_ANSI.sub("", text).splitlines(), 0)
