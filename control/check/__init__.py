"""``unbroken check``: everything that can be known about a run before it runs, without staging or training -- the
config (loaded and checked by the caller), the model, every record of the data sources read as staging reads them
(``scan.py``), the cluster, the storage, and a plan (world size, batches, steps <-> epochs, memory per worker against
what a worker has, the training's time: ``plan.py``, ``schedule.py``). ``unbroken run`` performs the same checks but
the plan first (:func:`refuse_early`), reading only the sources' first records (``probes.data``: its staging reads
every one moments later, and a run of data staged before reads none), so what they find stops a run before Prefect,
staging or a cluster is touched.

What is certain is a problem (exit 2): a model or source that cannot be read, what staging would refuse of the
records (rejects over ``data.max_reject_fraction``, an empty train or eval split), a LoRA target not in the model, a
storage that cannot be written, a cluster address that does not answer, ``cluster.use_gpu`` on a machine without a GPU
for its local head, a plan that does not fit. What may change before the run needs it is a warning: an existing
cluster short of CPUs or GPUs now (the run waits ``cluster.start_timeout_s`` for nodes to join).
"""

from __future__ import annotations

import os

from control.check import plan as plans
from control.check import probes
from control.check.findings import Finding, Report, RunRefused, ok, problem, warning
from ray_jobs.config import Config
from ray_jobs.errors import UserError

__all__ = ["Finding", "Report", "RunRefused", "check", "cluster", "refuse_early"]


def check(cfg: Config, worker_memory: float | None = None) -> Report:
    """Every check and the plan. ``worker_memory``: bytes a worker has (a GPU's memory with ``cluster.use_gpu``,
    else its share of a node's), when the cluster cannot say (any cluster but a local head on this machine)."""
    from control.check import scan, schedule

    report = Report()
    found, shape = probes.model(cfg)
    report.add(found)
    report.add(probes.rewards(cfg))
    found, scanned = scan.data(cfg)  # every record, as staging reads it
    report.add(found)
    found, have = cluster(cfg)
    report.add(found)
    report.add(probes.storage(cfg))
    timing, run = schedule.findings(cfg, schedule.manifest(scanned)) if scanned is not None else ([], cfg)
    if scanned is None and cfg.train.epochs is not None:
        timing = [warning("plan", f"train.epochs={cfg.train.epochs}: its steps are unknown until the data is read")]
    if shape is not None:
        available, source = (worker_memory, "as given") if worker_memory else have
        p = plans.plan(run, shape, cfg.cluster.use_gpu, available, source)
        report.add([ok("plan", line) for line in p.lines()])
        if (why := p.problem()) is not None:
            report.add([problem("plan", why)])
    report.add(timing)
    return report


def refuse_early(cfg: Config, with_cluster: bool = True) -> list[Finding]:
    """``run``'s (and ``tune``'s; ``stage``'s without the cluster) checks before anything else: the model, the data
    sources, the cluster, the storage -- no plan: an estimate does not stop a run, and the module tree is built only
    to check ``model.lora``. Raises RunRefused naming every problem; returns the warnings."""
    report = Report()
    report.add(probes.model(cfg, build=False)[0])
    report.add(probes.rewards(cfg))
    report.add(_data_early(cfg))
    if with_cluster:
        report.add(cluster(cfg)[0])
    report.add(probes.storage(cfg))
    report.refuse()
    return [f for f in report.findings if f.warning]


def early_scan_bytes() -> float:
    """Local sources up to this size are read in full before a run or a staging starts (``UNBROKEN_EARLY_SCAN_MB``,
    default 4): a bad record is then named in a second, before Prefect, instead of by staging a while later."""
    try:
        return float(os.environ.get("UNBROKEN_EARLY_SCAN_MB", "4")) * 1e6
    except ValueError:
        return 4e6


def _data_early(cfg: Config) -> list[Finding]:
    """Every record, as ``check`` reads them, when the sources are local and small (:func:`early_scan_bytes`); else
    the first records of each (staging reads the rest)."""
    from control.check import scan
    from ray_jobs.storage import is_local

    d = cfg.data
    named = [d.train] if isinstance(d.train, str) else [s.path for s in d.train]  # a hub dataset's: None
    paths = [p for p in [*named, d.eval] if p is not None]
    if None in named or not all(map(is_local, paths)) or _size(paths) > early_scan_bytes():
        return probes.data(cfg)
    found, _ = scan.data(cfg)
    return [f for f in found if f.problem or f.warning]


def _size(paths: list[str]) -> float:
    """Bytes of the sources' files, listed as staging lists them (a folder's data files only); 0 when one cannot be
    listed (the scan names it)."""
    from ray_jobs.data.fingerprint import describe

    try:
        return float(sum(f.size for p in paths for f in describe(p, "data")))
    except UserError:
        return 0.0


def cluster(cfg: Config) -> tuple[list[Finding], tuple[float | None, str]]:
    """The cluster the run would use: a local head's machine, or the cluster reached at its address with its nodes.
    Also what a worker has (bytes, where the figure comes from), when known."""
    from control.backends import backend_for
    from control.backends.base import reachable

    backend = backend_for(cfg)
    if backend.mode == "local":  # up or not, the head is this machine's
        return _this_machine(cfg)
    if backend.mode == "existing":
        if why := reachable(cfg.cluster.address):
            return [problem("cluster", f"cluster.address {cfg.cluster.address} is not reachable: {_short(why)}")], (
                None,
                "",
            )
        return _reached(cfg, cfg.cluster.address)
    try:
        address = backend.address()
    except Exception as e:  # a Kubernetes API that errs, a missing kubeconfig: the run's own `up` will say
        return [
            warning(
                "cluster",
                f"cannot tell whether its cluster (cluster.backend {backend.name}) is up: {type(e).__name__}: {e}",
            )
        ], (None, "")
    if address is not None:
        return _reached(cfg, address)
    return [ok("cluster", f"no cluster up yet: the run brings one up (cluster.backend {backend.name})")], (None, "")


def _short(why: str) -> str:
    """An HTTP client's reason without its wrappers: ``[Errno 111] Connection refused`` when it holds one."""
    import re

    m = re.search(r"\[Errno -?\d+\] [^'\")]+", why)
    return m.group(0) if m else why


def _this_machine(cfg: Config) -> tuple[list[Finding], tuple[float | None, str]]:
    from control.backends.fit import resource_problems

    cpus = float(os.cpu_count() or 1)
    gpus = probes.local_gpus() if cfg.cluster.use_gpu else 0
    found = [
        ok(
            "cluster",
            f"a local Ray head on this machine (the run starts it): {cpus:g} CPUs"
            + (f", {gpus} GPUs" if cfg.cluster.use_gpu else ""),
        )
    ]
    # nothing joins a local head: a shortfall is certain
    found += [problem("cluster", p) for p in resource_problems(cfg, {"CPU": cpus, "GPU": float(gpus)}, True)]
    if cfg.cluster.use_gpu:
        memory = probes.gpu_memory()
        return found, (memory, "this machine's GPU") if memory else (None, "")
    return found, (probes.machine_memory() / max(1, cfg.workers[0]), "this machine's memory / workers")


def _reached(cfg: Config, address: str) -> tuple[list[Finding], tuple[float | None, str]]:
    from control.backends import health
    from control.backends.fit import resource_problems, resources

    h = health.read(address)
    if h.nodes is None:
        return [warning("cluster", f"{address} answers; its nodes could not be read ({h.why})")], (None, "")
    total = resources(h)
    found = [ok("cluster", f"{address}: {len(h.alive)} node(s) alive, {total['CPU']:g} CPUs, {total['GPU']:g} GPUs")]
    wait = f" now; the run waits up to cluster.start_timeout_s={cfg.cluster.start_timeout_s:g} s for nodes to join"
    found += [warning("cluster", p + wait) for p in resource_problems(cfg, total)]
    return found, (None, "")
