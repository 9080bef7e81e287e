"""The cluster's shape and headroom, read from outside: nodes alive against those expected, GPUs per node, object
store use, free disk. The watchdog looks at it on every pass over a running job, so trouble that will kill the job
(a node gone, a GPU fallen off the bus, an object store or a disk filling up) is named before it does.

One authenticated, uncached GET of the dashboard's node summary (``/nodes?view=summary``, what the dashboard's own
Cluster page reads) gives every node's state, resources, object store use, visible GPUs and disks (the root file
system and Ray's temp dir); a local storage path is measured here. Why not ``ray.util.state.list_nodes``: it has
neither the object store use nor the disks, and a Ray client connection per pass is heavier than one HTTP request.

Each finding has a kind (``nodes-missing``, ``gpus-missing``, ``object-store-full``, ``disk-low``) and a message
naming the node and the number; :func:`assess` is pure, unit-tested on recorded summaries.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

from ray_jobs.config import Config

OBJECT_STORE_WARN = 0.90  # of a node's object store in use
DISK_WARN_FRACTION = 0.05  # free below this fraction of a disk ...
DISK_WARN_BYTES = 2 * 1024**3  # ... and below this many bytes (a big disk's 5 % is still plenty)


@dataclass
class Node:
    node_id: str
    ip: str
    alive: bool
    head: bool
    cpus: float = 0.0
    gpus: float = 0.0  # what the node advertises to Ray
    gpus_visible: int | None = None  # what its reporter sees now (None: it reports none at all)
    store_used: int = 0
    store_total: int = 0
    disks: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (free, total) bytes


@dataclass
class Finding:
    kind: str
    message: str

    def key(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class Health:
    nodes: list[Node] | None  # None: the summary could not be read (``why`` says why)
    why: str = ""

    @property
    def alive(self) -> list[Node]:
        return [n for n in self.nodes or [] if n.alive]


def parse_summary(body: dict[str, Any]) -> list[Node]:
    """Nodes from the dashboard's ``/nodes?view=summary`` answer."""
    out = []
    for entry in body["data"]["summary"]:
        raylet = entry.get("raylet") or {}
        total = raylet.get("resourcesTotal") or {}
        used = int(raylet.get("objectStoreUsedMemory") or 0)
        avail = int(raylet.get("objectStoreAvailableMemory") or 0)
        disks = {p: (int(d["free"]), int(d["total"])) for p, d in (entry.get("disk") or {}).items() if d.get("total")}
        gpus = entry.get("gpus")
        out.append(
            Node(
                node_id=raylet.get("nodeId", ""),
                ip=raylet.get("nodeManagerAddress") or entry.get("ip", ""),
                alive=raylet.get("state") == "ALIVE",
                head=bool(raylet.get("isHeadNode")),
                cpus=float(total.get("CPU", 0)),
                gpus=float(total.get("GPU", 0)),
                gpus_visible=len(gpus) if isinstance(gpus, list) and (gpus or total.get("GPU")) else None,
                store_used=used,
                store_total=used + avail,
                disks=disks,
            )
        )
    return out


def read(address: str, timeout_s: float = 10.0) -> Health:
    """The cluster's nodes as its dashboard reports them, or why they could not be read."""
    from control.rayapi import first_line as _first_line
    from control.rayapi import get as _get

    # nocache=1: the dashboard caches this route stale-while-revalidate (ray.dashboard.optional_utils.aiohttp_cache):
    # once its 2 s are up, the next request still gets the old answer and only starts a refresh. A watchdog asks once
    # a pass, so without it every look would report the cluster as it was one pass ago (a dead node still alive).
    r, why = _get(address, "/nodes?view=summary&nocache=1", timeout_s)
    if r is None:
        return Health(None, why)
    if r.status_code != 200:
        return Health(None, f"HTTP {r.status_code} from the dashboard: {_first_line(r.text)}")
    try:
        return Health(parse_summary(r.json()))
    except (ValueError, KeyError, TypeError) as e:
        return Health(None, f"the dashboard's node summary is not what this version reads: {type(e).__name__}: {e}")


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def disk_usage(path: str) -> tuple[int, int] | None:
    """(free, total) bytes of a local path's file system (None for an object store URL or a missing path)."""
    if "://" in path:
        return None
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free, usage.total


def _low(free: int, total: int) -> bool:
    return free < total * DISK_WARN_FRACTION and free < DISK_WARN_BYTES


def assess(health: Health, cfg: Config, expected_nodes: int, storage: tuple[int, int] | None = None) -> list[Finding]:
    """What about the cluster may kill the job, as findings (none: nothing to say). ``expected_nodes``: how many
    nodes the run's cluster had at its biggest (the watchdog keeps that count); ``storage``: free/total of the
    run's storage when it is a local (shared) path."""
    alive = health.alive
    out = missing_nodes(health, expected_nodes) + missing_gpus(alive, cfg)
    for n in alive:
        out += node_findings(n, cfg)
    if storage is not None and _low(*storage):
        out.append(
            Finding(
                "disk-low",
                f"storage {cfg.storage} has {_gib(storage[0])} free of {_gib(storage[1])}: "
                "the next checkpoint may not fit",
            )
        )
    return out


def missing_nodes(health: Health, expected_nodes: int) -> list[Finding]:
    """Fewer nodes alive than the cluster had at its biggest, naming the dead ones."""
    alive = health.alive
    if len(alive) >= expected_nodes:
        return []
    back = {n.ip for n in alive}  # a host whose node died and came back (a new node) is not missing
    gone = [n.ip or n.node_id[:12] for n in health.nodes or [] if not n.alive and n.ip not in back]
    dead = f" (dead: {', '.join(sorted(set(gone)))})" if gone else ""
    return [Finding("nodes-missing", f"{len(alive)} of {expected_nodes} nodes alive" + dead)]


def missing_gpus(alive: list[Node], cfg: Config) -> list[Finding]:
    """Fewer GPUs across the cluster than its workers need (a run that uses GPUs)."""
    if not cfg.cluster.use_gpu:
        return []
    total = sum(n.gpus for n in alive)
    if total >= cfg.workers[0]:
        return []
    message = (
        f"the cluster has {total:g} GPUs; cluster.num_workers needs at least "
        f"{cfg.workers[0]} (one per worker, standbys included)"
    )
    return [Finding("gpus-missing", message)]


def node_findings(n: Node, cfg: Config) -> list[Finding]:
    """One live node's trouble: GPUs it advertises but no longer sees, its object store filling up, a disk low."""
    out: list[Finding] = []
    if n.gpus_visible is not None and n.gpus_visible < n.gpus:
        message = (
            f"node {n.ip} gives Ray {n.gpus:g} GPUs but only {n.gpus_visible} "
            "are visible on it now (a GPU fell off the bus or its driver failed)"
        )
        out.append(Finding("gpus-missing", message))
    if n.store_total and n.store_used / n.store_total > OBJECT_STORE_WARN:
        message = (
            f"node {n.ip}: object store {n.store_used / n.store_total:.0%} "
            f"used ({_gib(n.store_used)} of {_gib(n.store_total)}); objects spill to disk, then "
            "tasks fail"
        )
        out.append(Finding("object-store-full", message))
    for path, (free, size) in sorted(n.disks.items()):
        if _low(free, size):
            message = (
                f"node {n.ip}: {path} has {_gib(free)} free of {_gib(size)} "
                f"(node caches and Ray's spill files live on it; data.cache_dir: "
                f"{cfg.data.cache_dir})"
            )
            out.append(Finding("disk-low", message))
    return out
