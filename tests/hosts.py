"""Several "hosts" on this machine for multi-node tests: each a network namespace with its own address on a private
bridge, and its own PID namespace, so a whole host is killed at once (its namespace's first process dies, the kernel
kills every other one) or cut off the network (its link taken down).

One Ray node runs per host (``ray start --block`` as the namespace's first process); the test process reaches the
head over the bridge like a client on another machine would. Storage and the node caches stay on the shared file
system, as they would on an NFS mount. Needs root (``ip netns``, ``unshare``); a leftover of a crashed session
(namespaces, bridge, processes with this harness's tag) is removed before a new one starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.procs import wait_for

VENV_BIN = Path(sys.executable).parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str
    ns: str  # network namespace
    addr: str  # its address on the bridge
    link: str  # the bridge side of its veth: down = cut off
    temp_dir: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def pids(self) -> list[int]:
        """Every process in this host's network namespace (as seen from the machine)."""
        out = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Hosts:
    """``count`` hosts named ``h0``... on 10.<octet>.0.0/24 (``h0`` at .10, ``h1`` at .11, ...); the bridge is .1."""

    def __init__(self, tag: str, count: int, octet: int, root: Path, hidden: Path | None = None):
        self.tag, self.octet, self.root = tag, octet, root
        # A folder only this machine sees (the flow's host): on every host an empty tmpfs covers it, in the host's
        # own mount namespace -- as a laptop's data folder is absent on a remote cluster.
        self.hidden = hidden
        self.bridge = f"{tag}br"
        self.hosts = [
            Host(f"h{i}", f"{tag}-h{i}", f"10.{octet}.0.{10 + i}", f"{tag}v{i}", root / f"h{i}") for i in range(count)
        ]
        self.head: Host | None = None
        self.gcs_port = self.dashboard_port = 0
        self.redis: subprocess.Popen | None = None
        self.redis_address = ""  # the head's GCS keeps its state there (GCS fault tolerance) once start_redis ran

    # -- the network -------------------------------------------------------------------------------------------
    def up(self) -> Hosts:
        self.down()  # a crashed session's leftovers
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.{self.octet}.0.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("link", "set", h.link, "master", self.bridge)
            _ip("link", "set", h.link, "up")
            for cmd in (["addr", "add", f"{h.addr}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"]):  # fmt: skip
                _ip("netns", "exec", h.ns, "ip", *cmd)
        return self

    def down(self) -> None:
        for h in self.hosts:
            self.kill(h)
            _ip("netns", "del", h.ns, check=False)
            _ip("link", "del", h.link, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait()
        # a crashed session's Redis (its process title names its address)
        subprocess.run(["pkill", "-KILL", "-f", f"^redis-server 10.{self.octet}.0.1:"], capture_output=True)

    def start_redis(self, port: int) -> str:
        """Redis for the head's GCS fault tolerance (Debian's ``redis-server``), on the machine's side of the bridge --
        outside every host, as a managed Redis is -- empty and keeping nothing on disk; its address. A head started
        after this keeps its GCS state there (``RAY_REDIS_ADDRESS``): killed and started again at its address, it
        finds the cluster's actors, jobs and nodes where it left them."""
        addr = f"10.{self.octet}.0.1"
        server = shutil.which("redis-server") or "/usr/bin/redis-server"
        log = (self.root / "redis.log").open("ab")
        self.redis = subprocess.Popen(
            [server, "--bind", addr, "--port", str(port), "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_for("redis-server", lambda: _accepts(addr, port), timeout_s=30, every_s=0.1)
        self.redis_address = f"{addr}:{port}"
        return self.redis_address

    # -- Ray nodes ---------------------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "TMPDIR", "USER") or k.startswith("RAY_")}
        env.update(
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            RAY_AUTH_MODE="token",
            RAY_USAGE_STATS_ENABLED="0",
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="eth0",
        )  # fmt: skip  (gloo: the host's own address, not the shared hostname's)
        if self.redis_address:  # GCS fault tolerance: every node waits out a head's restart (Ray's default: 60 s)
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "300"
        return env

    # Ray's defaults count a silent node dead after 5 missed checks of up to 10 s each, ~65 s (a killed node's refused
    # connections fail faster, ~15 s); these make it ~25 s so a 60 s partition outlasts it, as the scenario needs.
    HEALTH_CHECK = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "3000",
                    "RAY_health_check_failure_threshold": "5"}  # fmt: skip

    def _start(self, h: Host, args: list[str], env: dict[str, str] | None = None) -> None:
        shutil.rmtree(h.temp_dir, ignore_errors=True)
        h.temp_dir.mkdir(parents=True)
        log = (self.root / f"{h.name}.log").open("ab")
        ray = [str(VENV_BIN / "ray"), "start", "--block", f"--node-ip-address={h.addr}", f"--temp-dir={h.temp_dir}",
               "--disable-usage-stats", *args]  # fmt: skip
        if self.hidden is not None:  # ray start stays the namespace's first process (exec)
            ray = ["sh", "-c", f'mount -t tmpfs flow-host-only {self.hidden} && exec "$@"', "sh", *ray]
        cmd = ["ip", "netns", "exec", h.ns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *ray]
        h.proc = subprocess.Popen(
            cmd, env=self._env() | (env or {}), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_sshd(self, h: Host, key: Path) -> None:
        """The host as a machine the Ray cluster launcher reaches: ``sshd`` as its PID namespace's first process
        (so whatever a login starts -- Ray's daemons -- lives and dies with the host, and ``ray stop`` there sees
        only the host's own processes), root logging in with ``key`` (an ed25519 key pair, ``key`` and
        ``key.pub``), a default route through the bridge so Ray finds the host's own address."""
        h.temp_dir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "exec", h.ns, "ip", "route", "replace", "default", "via", f"10.{self.octet}.0.1", check=False)
        conf = h.temp_dir / "sshd_config"
        shutil.copy(key.with_suffix(".pub"), h.temp_dir / "authorized_keys")
        conf.write_text("\n".join([
            f"ListenAddress {h.addr}", "Port 22", f"HostKey {key}", f"AuthorizedKeysFile {h.temp_dir}/authorized_keys",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", f"PidFile {h.temp_dir}/sshd.pid", "MaxStartups 50", "MaxSessions 50",
        ]) + "\n")  # fmt: skip
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
        # A login there finds this checkout's Ray on its PATH, as a machine with Ray installed would: a profile
        # script bind-mounted over /etc/profile.d in the host's own mount namespace (the machine's is untouched).
        profile = h.temp_dir / "profile.d"
        profile.mkdir(exist_ok=True)
        (profile / "unbroken-ray.sh").write_text(f'export PATH="{VENV_BIN}:$PATH"\n')
        log = (self.root / f"{h.name}.log").open("ab")
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        cmd = ["ip", "netns", "exec", h.ns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c",
               f"mount --bind {profile} /etc/profile.d && exec {sshd} -D -e -f {conf}"]  # fmt: skip
        h.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(f"sshd on {h.name}", lambda: _listening(h, 22), timeout_s=30, every_s=0.2)

    def start_head(self, h: Host, gcs_port: int, dashboard_port: int, num_cpus: int = 0) -> str:
        """The head on ``h`` (no CPUs of its own by default: training runs on the worker hosts); its Jobs API URL."""
        self.head, self.gcs_port, self.dashboard_port = h, gcs_port, dashboard_port
        subprocess.run([str(VENV_BIN / "ray"), "get-auth-token", "--generate"], env=self._env(), capture_output=True)
        ft = {"RAY_REDIS_ADDRESS": self.redis_address} if self.redis_address else {}
        self._start(h, ["--head", f"--port={gcs_port}", "--dashboard-host=0.0.0.0", f"--dashboard-port={dashboard_port}",
                        f"--num-cpus={num_cpus}"], self.HEALTH_CHECK | ft)  # fmt: skip
        address = f"http://{h.addr}:{dashboard_port}"
        from control.backends.base import reachable

        wait_for(f"the head on {h.name}", lambda: reachable(address) is None, timeout_s=90, every_s=0.5)
        return address

    def start_cluster(self, gcs_port: int, dashboard_port: int, redis_port: int | None = None) -> Hosts:
        """A head on the first host (no CPUs) and a one-CPU worker node on each of the others; with ``redis_port``,
        the head's GCS keeps its state in a Redis of its own (:meth:`start_redis`)."""
        if redis_port is not None:
            self.start_redis(redis_port)
        self.start_head(self.hosts[0], gcs_port, dashboard_port)
        for h in self.hosts[1:]:
            self.start_worker(h)
        return self

    def start_worker(self, h: Host, num_cpus: int = 1, tries: int = 2) -> None:
        """A Ray worker node on ``h``, waited for until the head counts it alive. On an overloaded machine the head's
        shortened health checks (HEALTH_CHECK) can count a node that is still joining dead, and its raylet then exits
        ("mistakenly been marked as dead by the GCS", seen once in CI with the machine 98 % busy): a node whose
        ``ray start`` ended before it joined is started again, ``tries`` times in all."""
        assert self.head is not None
        before = self.alive_nodes()
        for _ in range(tries):
            self._start(h, [f"--address={self.head.addr}:{self.gcs_port}", f"--num-cpus={num_cpus}"])
            proc = h.proc
            assert proc is not None
            seen = wait_for(f"worker host {h.name} to join (or its ray start to end)",
                            lambda p=proc: ("joined" if h.addr in self.alive_nodes() - before else None)
                            or ("ended" if p.poll() is not None else None), timeout_s=120, every_s=0.5)  # fmt: skip
            if seen == "joined":
                return
        raise TimeoutError(f"worker host {h.name} did not join: its ray start ended {tries} times (see {h.name}.log)")

    def sees(self, h: Host, path: Path) -> bool:
        """Whether ``path`` exists on ``h`` (in its mount namespace: that of its first process)."""
        assert h.proc is not None
        return subprocess.run(["nsenter", "-t", str(h.proc.pid), "-m", "test", "-e", str(path)]).returncode == 0

    def alive_nodes(self) -> set[str]:
        """Addresses of the nodes the cluster counts alive (asked from the head, as a client)."""
        from ray.util.state import list_nodes

        with contextlib.suppress(Exception):
            address = f"http://{self.head.addr}:{self.dashboard_port}"
            return {n.node_ip for n in list_nodes(address=address, raise_on_missing_output=False) if n.state == "ALIVE"}
        return set()

    def node_id(self, h: Host) -> str:
        """The hex id of the live Ray node on ``h``."""
        from ray.util.state import list_nodes

        address = f"http://{self.head.addr}:{self.dashboard_port}"
        ids = [n.node_id for n in list_nodes(address=address) if n.node_ip == h.addr and n.state == "ALIVE"]
        assert len(ids) == 1, f"{h.name}: expected one live node, found {ids}"
        return ids[0]

    # -- faults ------------------------------------------------------------------------------------------------
    def drain(self, h: Host, deadline_s: float, reason: str = "DRAIN_NODE_REASON_PREEMPTION") -> None:
        """A preemption notice for ``h``'s node, as a cloud's spot reclaim gives one: Ray's own (hidden, developer)
        ``ray drain-node``, which asks the GCS to drain the node by a deadline. Ray stops placing work on it."""
        out = subprocess.run(
            [str(VENV_BIN / "ray"), "drain-node", f"--address={self.head.addr}:{self.gcs_port}",
             f"--node-id={self.node_id(h)}", f"--reason={reason}", "--reason-message=unbroken test: spot reclaim",
             f"--deadline-remaining-seconds={int(deadline_s)}"],
            env=self._env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, f"ray drain-node {h.name}: {out.stdout}{out.stderr}"

    def kill(self, h: Host) -> None:
        """Every process of the host at once: SIGKILL its PID namespace's first process, the kernel does the rest."""
        if h.proc is not None and h.proc.poll() is None:
            os.killpg(h.proc.pid, signal.SIGKILL)
            h.proc.wait()
        for pid in h.pids():  # anything that joined the namespace otherwise (never expected)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(f"every process of {h.name} gone", lambda: not h.pids(), timeout_s=30, every_s=0.1)

    def partition(self, h: Host) -> None:
        _ip("link", "set", h.link, "down")

    def heal(self, h: Host) -> None:
        _ip("link", "set", h.link, "up")

    def training_hosts(self) -> list[Host]:
        """Hosts running a Ray Train worker now."""
        return [h for h in self.hosts if any(b"RayTrainWorker" in _cmdline(p) for p in h.pids())]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _listening(h: Host, port: int) -> bool:
    out = _ip("netns", "exec", h.ns, "ss", "-ltn", check=False).stdout
    return f"{h.addr}:{port} " in out


def can_make_hosts() -> str | None:
    """None when this machine can run the harness, else why not."""
    if os.geteuid() != 0:
        return "needs root for network and PID namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def wait_gone(hosts: Hosts, h: Host, timeout_s: float = 120) -> float:
    """Seconds until the cluster counts ``h``'s node dead."""
    t0 = time.monotonic()
    wait_for(f"{h.name} counted dead", lambda: h.addr not in hosts.alive_nodes(), timeout_s=timeout_s, every_s=0.5)
    return time.monotonic() - t0
