"""A real ``prefect server start`` on loopback for tests: one per session for the CLI runs (each ``unbroken run``
otherwise boots an ephemeral server of its own, ~10 s each here, ~28 s on a fresh database), and one per module where
a test restarts it."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.procs import free_port, wait_for

# Services a server that only records flow runs started from the command line never needs (no deployment, work
# pool, schedule, automation or pause there): off, an idle server takes ~1.7 % of a core instead of ~5 %.
IDLE_SERVICES = ("SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "REPOSSESSOR", "CANCELLATION_CLEANUP",
                 "DB_VACUUM", "CLEANUP_RECONCILER", "TRIGGERS")  # fmt: skip


class PrefectServer:
    """``prefect server start`` (SQLite, all services, or without :data:`IDLE_SERVICES` when ``lean``) on a loopback
    port; can be restarted on the same port and database, as an operator restarting it would."""

    def __init__(self, home: Path, lean: bool = False):
        self.home, self.port, self.lean = home, free_port(), lean
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.log = open(home / "server.log", "a")  # noqa: SIM115 (closed by close)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api,
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")  # fmt: skip
        on = "false" if self.lean else "true"  # (tests/conftest.py turns them off for the session's ephemeral servers)
        env |= {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": on for name in IDLE_SERVICES}
        prefect = str(Path(sys.executable).parent / "prefect")
        self.proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for("the Prefect server", self.healthy, 90, 1.0)

    def healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.api}/health", timeout=2).read() == b"true"
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        self.log.close()


@contextmanager
def serving(home: Path, environ: bool = False, lean: bool = False):
    """A started server that this test process is a client of (``temporary_settings``); ``environ`` also exports
    ``PREFECT_API_URL`` so that every process the tests start (``unbroken run``, watchdogs) uses it too; ``lean``:
    without the services only deployments, schedules and automations need."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = PrefectServer(home, lean)
    server.start()
    before = os.environ.get("PREFECT_API_URL")
    if environ:
        os.environ["PREFECT_API_URL"] = server.api
    try:
        with temporary_settings({PREFECT_API_URL: server.api}):
            yield server
    finally:
        if environ:
            if before is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = before
        server.close()
