"""Small helpers for tests that run real processes: free ports, waiting for a condition, finding processes."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import psutil

from ray_jobs.poll import poll_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, predicate: Callable[[], object], timeout_s: float = 120, every_s: float = 0.05):
    """Poll ``predicate`` until it returns something truthy (returned), or raise TimeoutError naming ``what``."""
    value = poll_until(predicate, timeout_s, every_s)
    if value:
        return value
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def processes() -> Iterator[tuple[int, bytes]]:
    """(pid, command line with its arguments joined by spaces) of every process on this machine."""
    for p in psutil.process_iter(["cmdline"]):  # a process gone meanwhile, or not ours to read, has cmdline None
        yield p.pid, " ".join(p.info["cmdline"] or ()).encode()


def train_worker_pids(head_port: int) -> list[int]:
    """PIDs of the live Ray Train worker processes of the local head on ``head_port`` (its dashboard port): never a
    worker of another head on this machine, such as another test lane's (their process title names the actor)."""
    from control.backends.local import head_pids

    mine = set(head_pids(head_port))
    return sorted(pid for pid, cmdline in processes() if b"RayTrainWorker" in cmdline and pid in mine)


def scrape(url: str, name: str, **labels: str) -> list[float]:
    """The value of every series ``name`` whose labels include ``labels`` at a Prometheus endpoint (``[]`` when
    there is none, or the endpoint does not answer)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return []
    return [s.value for family in text_string_to_metric_families(body) for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()]  # fmt: skip
