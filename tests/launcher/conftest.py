"""Machines for the Ray cluster launcher (``cluster.backend: ray-up``): four network- and PID-namespace hosts
(tests/hosts.py) that run only ``sshd``, reached by ``ray up`` over SSH as root with a key made here. The cluster
YAML is the shipped configs/clusters/onprem.yaml with these hosts' addresses and key, and this checkout's Ray (the
hosts share this machine's file system, so there is nothing to install: the setup commands are dropped)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.hosts import VENV_BIN, Hosts, can_make_hosts

ONPREM = ROOT / "configs" / "clusters" / "onprem.yaml"


@pytest.fixture(scope="package")
def machines(tmp_path_factory) -> Hosts:
    why = can_make_hosts()
    assert why is None, f"the launcher tests cannot build hosts here: {why}"
    for tool in ("sshd", "rsync", "ssh"):
        assert subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode == 0, (
            f"the launcher tests need {tool}: `make hosts-tools` installs openssh-server and rsync"
        )
    root = tmp_path_factory.mktemp("machines")
    key = root / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    hs = Hosts("ubru", 4, 78, root).up()
    try:
        for h in hs.hosts:
            hs.start_sshd(h, key)
        hs.key = key
        yield hs
    finally:
        hs.down()


def cluster_yaml(machines: Hosts, path: Path) -> Path:
    """configs/clusters/onprem.yaml for these hosts: h0 the head (no CPUs: training runs on workers), h1..h3 workers
    of one CPU each; Ray's health checks quicker (a dead node counted dead in ~10 s, not ~65 s)."""
    spec = yaml.safe_load(ONPREM.read_text())
    head, *workers = machines.hosts
    spec["cluster_name"] = "unbroken-test-onprem"
    spec["provider"].update(head_ip=head.addr, worker_ips=[w.addr for w in workers])
    spec["auth"] = {"ssh_user": "root", "ssh_private_key": str(machines.key)}
    spec["min_workers"] = spec["max_workers"] = len(workers)
    spec["setup_commands"] = []
    ray = str(VENV_BIN / "ray")
    env = (
        "export GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_health_check_period_ms=2000 "
        "RAY_health_check_timeout_ms=3000 RAY_health_check_failure_threshold=3 PATH=" + str(VENV_BIN) + ":$PATH; "
    )
    temp = "--temp-dir=/tmp/ubru-$(hostname -I | cut -d' ' -f1)"  # each host its own (the file system is shared)
    spec["head_start_ray_commands"] = [
        f"{ray} stop",
        env + f"ulimit -n 65536; RAY_AUTH_MODE=token {ray} start --head --port=6379 --dashboard-host=0.0.0.0 "
        f"--num-cpus=0 --autoscaling-config=~/ray_bootstrap_config.yaml --disable-usage-stats {temp}",
    ]
    spec["worker_start_ray_commands"] = [
        f"{ray} stop",
        env + f"ulimit -n 65536; RAY_AUTH_MODE=token {ray} start --address=$RAY_HEAD_IP:6379 --num-cpus=1 "
        f"--disable-usage-stats {temp}",
    ]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
