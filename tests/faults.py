"""Test-only fault injection for real processes: a loopback TCP proxy that can answer 502, reset or swallow
connections for a while, and SIGSTOP/SIGCONT of processes for a while."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("pass", "http502", "reset", "blackhole")
BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: 11\r\nConnection: close\r\n\r\nbad gateway"


class FaultProxy:
    """Listens on 127.0.0.1:<free port>, forwards to ``host:port`` -- or, while a fault is on, answers every new
    connection with a 502 (``http502``), a TCP reset (``reset``) or nothing at all (``blackhole``). Switching to a
    fault also breaks the connections already forwarded, so keep-alive clients see it too. ``log`` records
    (time, mode, event) for every connection."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.mode = "pass"
        self.log: list[tuple[float, str, str]] = []
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._timer: threading.Timer | None = None
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str) -> None:
        assert mode in MODES, mode
        self.mode = mode
        self.log.append((time.time(), mode, "mode"))
        if mode != "pass":
            self._break_live()

    def inject(self, mode: str, for_s: float) -> None:
        """Fault for ``for_s`` seconds, then forward again."""
        if self._timer is not None:
            self._timer.cancel()
        self.set(mode)
        self._timer = threading.Timer(for_s, self.set, args=("pass",))
        self._timer.daemon = True
        self._timer.start()

    def faulted(self) -> int:
        """How many connections were faulted (not forwarded)."""
        return sum(1 for _, mode, event in self.log if event == "faulted")

    # -- plumbing -------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            mode = self.mode
            if mode == "pass":
                threading.Thread(target=self._forward, args=(client,), daemon=True).start()
                continue
            self.log.append((time.time(), mode, "faulted"))
            threading.Thread(target=self._fault, args=(client, mode), daemon=True).start()

    def _fault(self, client: socket.socket, mode: str) -> None:
        with contextlib.suppress(OSError):
            if mode == "http502":
                client.settimeout(2)
                with contextlib.suppress(OSError):
                    client.recv(65536)  # the request (or its start)
                client.sendall(BAD_GATEWAY)
                client.close()
            elif mode == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
            else:  # blackhole: hold it open, say nothing, until the fault ends
                with self._lock:
                    self._live.add(client)
                while self.mode == "blackhole" and not self._closed.is_set():
                    time.sleep(0.1)
                client.close()

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._live |= {client, upstream}
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        self._pipe(client, upstream)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            with self._lock:
                self._live.discard(s)

    def _break_live(self) -> None:
        with self._lock:
            live, self._live = list(self._live), set()
        for s in live:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._closed.set()
        self._server.close()
        self._break_live()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- pausing processes ---------------------------------------------------------------------------------------
_stopped: set[int] = set()


def _cont(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
        _stopped.discard(pid)


atexit.register(lambda: _cont(list(_stopped)))  # never leave a process stopped behind


@contextlib.contextmanager
def paused(pids: list[int] | int, seconds: float):
    """SIGSTOP the processes now and SIGCONT them after ``seconds`` (a timer; the body need not wait), and at the
    latest when the block ends -- also when it fails."""
    pids = [pids] if isinstance(pids, int) else list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            _stopped.add(pid)
    timer = threading.Timer(seconds, _cont, args=(pids,))
    timer.daemon = True
    timer.start()
    try:
        yield timer
    finally:
        timer.cancel()
        _cont(pids)


def listening_pids(port: int) -> list[int]:
    """PIDs holding a listening TCP socket on ``port`` (any address), from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd)[8:-1] in inodes for fd in (proc / "fd").iterdir() if _is_socket(fd)):
                pids.append(int(proc.name))
    return sorted(pids)


def _is_socket(fd: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.readlink(fd).startswith("socket:[")
    return False


def dashboard_pids(dashboard_port: int) -> list[int]:
    """The Ray dashboard serving ``dashboard_port`` (the process listening there: it answers the Jobs API)."""
    return listening_pids(dashboard_port)


# -- another host ---------------------------------------------------------------------------------------------
OTHER_HOST_PASSES = """
import json, sys, time
from control.watchdog import check_run
storage, run, passes, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
for _ in range(passes):
    o = check_run(storage, run)
    print(json.dumps({"action": o.action, "detail": o.detail}), flush=True)
    time.sleep(every)
"""


class OtherHost:
    """A second "host" sharing this machine's storage, as a laptop on the same NFS/S3 would: a network namespace
    of its own (its 127.0.0.1 leads nowhere) and a PID namespace of its own (this machine's processes are out of its
    reach), where watchdog passes run (``check_run``, the watchdog's whole work on one run) in the background."""

    def __init__(self, name: str):
        self.ns = name
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # a crashed session's leftover
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        self.proc = None

    def watchdog_passes(self, storage: str, run: str, passes: int, every_s: float, env: dict) -> None:
        cmd = ["ip", "netns", "exec", self.ns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
               sys.executable, "-c", OTHER_HOST_PASSES, storage, run, str(passes), str(every_s)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def outcomes(self, timeout_s: float = 120) -> list[dict]:
        """What each pass did (waits for the passes to end)."""
        out, err = self.proc.communicate(timeout=timeout_s)
        assert self.proc.returncode == 0, f"the other host's watchdog failed:\n{err[-3000:]}"
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def __enter__(self) -> OtherHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- a full disk ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(where: Path, size: str = "64k"):
    """A tmpfs of ``size`` mounted over ``where`` (root, as the multinode tier); yields ``(fill, free)``: fill it to
    the last byte, free it again. Unmounted when the block ends."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    assert mounted.returncode == 0, f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode()}"
    filler = where / ".filler"

    def fill() -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)

    try:
        yield fill, lambda: filler.unlink()
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
