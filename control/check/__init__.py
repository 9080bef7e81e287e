"""``unbroken check``: everything that can be known about a run before it runs, without staging or training -- the
config (loaded and checked by the caller), the model, the data sources, the cluster, the storage, and a plan (world
size, batches, steps, memory per worker against what a worker has). ``unbroken run`` performs the same checks but the
plan first (:func:`refuse_early`), so what they find stops a run before Prefect, staging or a cluster is touched.

What is certain is a problem (exit 2): a model or source that cannot be read, a LoRA target not in the model, a
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

__all__ = ["Finding", "Report", "RunRefused", "check", "cluster", "refuse_early"]


def check(cfg: Config, worker_memory: float | None = None) -> Report:
    """Every check and the plan. ``worker_memory``: bytes a worker has (a GPU's memory with ``cluster.use_gpu``,
    else its share of a node's), when the cluster cannot say (any cluster but a local head on this machine)."""
    report = Report()
    found, shape = probes.model(cfg)
    report.add(found)
    report.add(probes.data(cfg))
    found, have = cluster(cfg)
    report.add(found)
    report.add(probes.storage(cfg))
    if shape is not None:
        available, source = (worker_memory, "as given") if worker_memory else have
        p = plans.plan(cfg, shape, cfg.cluster.use_gpu, available, source)
        report.add([ok("plan", line) for line in p.lines()])
        if (why := p.problem()) is not None:
            report.add([problem("plan", why)])
    return report


def refuse_early(cfg: Config, with_cluster: bool = True) -> list[Finding]:
    """``run``'s (and ``tune``'s; ``stage``'s without the cluster) checks before anything else: the model, the data
    sources, the cluster, the storage -- no plan: an estimate does not stop a run, and the module tree is built only
    to check ``model.lora``. Raises RunRefused naming every problem; returns the warnings."""
    report = Report()
    report.add(probes.model(cfg, build=False)[0])
    report.add(probes.data(cfg))
    if with_cluster:
        report.add(cluster(cfg)[0])
    report.add(probes.storage(cfg))
    report.refuse()
    return [f for f in report.findings if f.warning]


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
