"""Where the suite's CPU goes: every process on the machine sampled once a second while ``make test`` runs, its CPU
time summed by what the process is (a Ray Train actor by its class, a Ray daemon, ``python -m <module>``, a console
script and its subcommand). ``tests/lanes.py`` runs one for both lanes and prints the table at the end; it is also
written to ``<report>/processes.tsv``.

psutil reads each process's own CPU time: a process that lives less than a second between two samples is missed,
and one that ends loses at most its last second. A Ray worker is counted under the last actor it ran (it starts as
``ray::IDLE``, importing Ray, before an actor takes it). Sampling costs about 1 % of a core.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

import psutil

SAMPLE_S = 1.0
_IDLE = {"ray::IDLE", "default_worker.py", "setup_worker.py"}  # a Ray worker before an actor takes it (setup_worker.py:
# one with a runtime env, before it execs the worker): classified again later
_SUBCOMMANDS = {"prefect", "unbroken", "ray", "torchrun"}  # console scripts named with their first argument


def kind(cmdline: list[str], name: str) -> str:
    """What a process is, from its command line (or its name when it has none: kernel threads, some daemons)."""
    if not cmdline:
        return name
    first = cmdline[0]
    if first.startswith("ray::"):  # a Ray worker's title: ray::<Actor>.<method> or ray::<task>
        return "ray::" + first[5:].split(".")[0].split(" ")[0].split("(")[0]
    if first.startswith("ray-dashboard-"):  # the dashboard's module processes (ray-dashboard-JobHead-0 ...)
        return "ray dashboard modules"
    args = cmdline[1:] if "python" in os.path.basename(first) else cmdline
    args = [a for a in args if a not in ("-u", "-B", "-S", "-E", "-s")]
    if len(args) >= 2 and args[0] == "-m":
        return f"-m {args[1]}"
    if args and args[0] == "-c":
        return "python -c"
    if not args:
        return os.path.basename(first)
    script = os.path.basename(args[0])
    sub = next((a for a in args[1:] if not a.startswith("-")), "")
    return f"{script} {sub}" if script in _SUBCOMMANDS and sub else script


class Sampler:
    """Samples in a daemon thread from :meth:`start` until :meth:`stop`; :meth:`table` sums what it saw."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, float], list] = {}  # (pid, started) -> [kind, cpu at first sight, cpu at last]
        self._first = True  # the first sample: what the processes already running had spent is not the suite's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-by-process", daemon=True)

    def start(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """One last sample, after the thread's last."""
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        for p in psutil.process_iter():
            try:
                key = (p.pid, p.create_time())
                t = p.cpu_times()
                cpu = t.user + t.system
                entry = self.seen.get(key)
                if entry is None:
                    entry = self.seen[key] = [kind(p.cmdline(), p.name()), cpu if self._first else 0.0, cpu]
                elif entry[0] in _IDLE:
                    entry[0] = kind(p.cmdline(), p.name())
                entry[2] = cpu
            except (psutil.Error, OSError):  # gone between listing and reading, or not ours to read
                continue
        self._first = False

    def table(self) -> list[tuple[str, float, int]]:
        """(kind, CPU seconds, processes), most CPU first."""
        cpu, count = Counter(), Counter()
        for what, first, last in self.seen.values():
            cpu[what] += last - first
            count[what] += 1
        return [(what, round(s, 1), count[what]) for what, s in cpu.most_common() if s >= 0.05]


def report(sampler: Sampler, out: Path, top: int = 20) -> None:
    """Print the ``top`` kinds and write them all to ``out`` (kind, CPU seconds, processes)."""
    rows = sampler.table()
    total = sum(s for _, s, _ in rows) or 1.0
    out.write_text("kind\tcpu_s\tprocesses\n" + "".join(f"{k}\t{s}\t{n}\n" for k, s, n in rows))
    print(f"\n== CPU by process ({total:.0f} CPU-s while the lanes ran; all in {out.name}) ==")
    print(f"{'CPU s':>8} {'%':>5} {'procs':>6}  what")
    for what, s, n in rows[:top]:
        print(f"{s:>8.1f} {100 * s / total:>5.1f} {n:>6}  {what}")
