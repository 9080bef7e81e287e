"""The cluster backends behind one interface, as tables over the four: what each checks in its config, records of
its cluster, repairs when a node is lost, stops when its cluster stops answering, leaves up when a run is done, and
leaves for a janitor. The watchdog and the flow only call these: no backend is named outside control/backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from control.backends import (
    BACKENDS,
    Backend,
    ClusterError,
    StopUnverified,
    backend_class,
    backend_for,
    handle_from_record,
    janitor_backends,
    kuberay,
    local,
    record,
)
from control.backends.base import ClusterHandle
from control.backends.localhost import host_identity
from control.config import load_config
from control.records.run import ClusterRecord
from ray_jobs.storage import Layout
from tests.conftest import ROOT

DEMO = ROOT / "configs" / "demo.yaml"
ONPREM = ROOT / "configs" / "clusters" / "onprem.yaml"
SETS = {
    "local": [],
    "address": ["cluster.address=http://head:8265"],
    "ray-up": ["cluster.backend=ray-up", f"cluster.ray_up.config={ONPREM}"],
    "kuberay": ["cluster.backend=kuberay", "cluster.kuberay.image=rayproject/ray:2.60.0", "storage=s3://b/u"],
}
HANDLE = ClusterHandle("http://h:8265", "http://h:8265", True, "python")


def cfg(name: str, *extra: str):
    return load_config(DEMO, [*SETS[name], *extra])


def test_each_backend_checks_its_own_section() -> None:
    from ray_jobs.config import ClusterConfig

    expected = {
        "local": [],
        "address": ["cluster.address: cluster.backend is address, but no address is given (http://head:8265)"],
        "ray-up": ["cluster.ray_up.config: cluster.backend ray-up needs the cluster YAML (what `ray up` takes)"],
        "kuberay": ["cluster.kuberay.image: cluster.backend kuberay needs the Ray image of its pods"],
    }
    for name, want in expected.items():
        assert backend_class(name).problems(ClusterConfig(backend=name), "s3://b/u") == want, name


@pytest.mark.parametrize(
    ("name", "mode", "local_head"),
    [("local", "local", True), ("address", "existing", False), ("ray-up", "managed", False),
     ("kuberay", "managed", False)],
)  # fmt: skip
def test_the_run_record_says_who_owns_the_cluster_and_gives_the_handle_back(name, mode, local_head) -> None:
    c = cfg(name)
    spec = {"made": "from this"}
    rec = record(c, {"address": "http://h:8265", "started_here": True, "spec": spec, "python": "x"})
    if local_head:  # recorded where the head runs: the host is part of it (a watchdog elsewhere leaves it alone)
        spec = spec | {"host": host_identity()}
    assert rec.dump() == {"address": "http://h:8265", "backend": name, "spec": spec, "mode": mode, "started_here": True}
    handle = handle_from_record(rec)
    assert (handle.backend, handle.local, handle.started_here, handle.spec) == (name, local_head, True, spec)


def test_a_record_from_before_backends_names_only_its_mode() -> None:
    old = ClusterRecord.model_validate  # what such a record holds
    assert handle_from_record(old({"address": "http://127.0.0.1:8265", "mode": "local"})).backend == "local"
    assert handle_from_record(old({"address": "http://h:8265", "mode": "existing"})).backend == "address"


def test_only_ray_up_asks_for_a_lost_node_back(monkeypatch) -> None:
    from control.backends.ray_up import RayUp

    ups = []
    monkeypatch.setattr(RayUp, "up", lambda self, run=None: ups.append(run))
    done = {name: backend_for(cfg(name)).replace_nodes("r") for name in SETS}
    assert done == {"local": None, "address": None, "ray-up": "ray-up up: replacement nodes requested",
                    "kuberay": None}  # fmt: skip
    assert ups == ["r"], "ray up again: Ray not restarted, the autoscaler starts the missing hosts"


OTHER_HOST = {"hostname": "elsewhere", "boot_id": "another-boot", "net_ns": "net:[1]", "pid_ns": "pid:[1]"}
# (backend, what its own view says, what it does): a destructive stop only on the backend's own evidence that the
# cluster is dead -- never on the Jobs API's silence alone -- and never another run's job on a shared head.
STOPS = [
    ("local", {"host": OTHER_HOST}, StopUnverified("runs on host elsewhere")),
    ("local", {"head": []}, "the local Ray head is gone"),
    ("local", {"head": [1, 2], "users": []}, "stopped the local Ray head's processes (no other run uses it)"),
    ("local", {"head": [1, 2], "users": ["other-run"], "job": [7]},
     "stopped the 1 process(es) of Ray job sid; the head itself is left up (other-run)"),
    ("ray-up", {"head_ip": None}, "down"),  # the launcher knows no head
    ("ray-up", {"head_ip": "10.0.0.1", "gcs": False}, "down"),  # the head refuses its GCS port too
    ("ray-up", {"head_ip": "10.0.0.1", "gcs": True}, StopUnverified("still accepts connections on its GCS port")),
    ("kuberay", {"obj": None}, "down"),
    ("kuberay", {"obj": {"status": {"state": "failed"}}}, "down"),
    ("kuberay", {"obj": {"status": {"state": "ready"}}}, StopUnverified("is ready by the Kubernetes API")),
    ("address", {}, StopUnverified("not unbroken's to take down")),
]  # fmt: skip


@pytest.mark.parametrize("name,view,expected", STOPS)
def test_what_each_backend_stops_when_its_cluster_stops_answering(monkeypatch, name, view, expected) -> None:
    from control.backends import localhost, ray_up

    stopped = []
    monkeypatch.setattr(local, "stop_local_head", lambda port: stopped.append(("head", port)))
    monkeypatch.setattr(local, "head_processes", lambda port: view.get("head", []))
    monkeypatch.setattr(local, "head_users", lambda port, ignore=None: view.get("users", []))
    monkeypatch.setattr(local, "job_processes", lambda sid: view.get("job", []))
    monkeypatch.setattr(local, "terminate", lambda procs, wait_s: stopped.append(("job", procs)))
    monkeypatch.setattr(localhost, "host_identity", lambda: {"hostname": "here", "boot_id": "b", "net_ns": "n",
                                                             "pid_ns": "p"})  # fmt: skip
    monkeypatch.setattr(ray_up.RayUp, "_head_ip", lambda self: view.get("head_ip"))
    monkeypatch.setattr(ray_up, "_accepts", lambda host, port: view.get("gcs", False))
    monkeypatch.setattr(kuberay.KubeRay, "_get", lambda self: view.get("obj"))
    monkeypatch.setattr(kuberay, "ready", lambda obj: obj["status"]["state"] == "ready")
    for cls in (backend_class("ray-up"), kuberay.KubeRay):
        monkeypatch.setattr(cls, "down", lambda self, handle, run=None: stopped.append((self.name, run)) or "down")
    handle = ClusterHandle("http://h:8265", "http://h:8265", True, "python", spec={"host": view.get("host", {})})
    if isinstance(expected, StopUnverified):
        with pytest.raises(StopUnverified, match=str(expected)):
            backend_for(cfg(name)).stop_unreachable(handle, "r", "sid")
        assert stopped == [], "nothing is stopped on the Jobs API's silence alone"
        return
    assert backend_for(cfg(name)).stop_unreachable(handle, "r", "sid").startswith(expected)
    killed_head = ("head", 8265) in stopped
    assert killed_head == (view.get("users") == [] and name == "local"), "the head only when no other run uses it"


@pytest.mark.parametrize("name", ["address", "ray-up", "kuberay"])
def test_a_cluster_is_left_up_unless_this_run_brought_it_up_and_did_not_keep_it(name) -> None:
    cls = backend_class(name)
    ours = ClusterHandle("http://h:8265", "http://h:8265", True, "python", backend=name)
    theirs = ClusterHandle("http://h:8265", "http://h:8265", False, "python", backend=name)
    assert cls.leave_up(cfg(name), ours) is None
    assert cls.leave_up(cfg(name), theirs) == "this run did not bring it up"
    assert cls.leave_up(cfg(name, "cluster.keep_running=true"), ours) == "cluster.keep_running"


def test_a_local_head_decides_by_its_own_users() -> None:
    head = ClusterHandle("http://127.0.0.1:8265", "http://127.0.0.1:8265", False, "python", local=True)
    assert backend_class("local").leave_up(cfg("local", "cluster.keep_running=true"), head) is None


def test_two_runs_of_one_name_in_two_storages_are_two_users_of_a_local_head(tmp_path: Path, monkeypatch) -> None:
    """Two projects on one machine both call their run ``twin``: the first to end leaves the head up for the other
    (it once counted the other's registration as its own, and stopped the head under it), the last stops it."""
    from control.backends import head_users, localhost

    monkeypatch.setattr(localhost, "HEADS_DIR", tmp_path / "heads")
    stopped = []
    monkeypatch.setattr(local, "stop_local_head", lambda port: stopped.append(port) or True)
    a, b = (backend_for(cfg("local", "name=twin", f"storage={tmp_path / p}")) for p in ("project-a", "project-b"))
    for backend in (a, b):
        head_users.add_user(8265, "twin", backend.cfg.storage)
    head = ClusterHandle("http://127.0.0.1:8265", "http://127.0.0.1:8265", True, "python", local=True)
    assert head_users.head_users(8265) == ["twin", "twin"]
    assert a.down(head, "twin") == "leaving the local Ray head up: still used by twin" and stopped == []
    assert b.down(head, "twin") == "stopped the local Ray head (its own processes only)" and stopped == [8265]


def test_only_kuberay_leaves_clusters_for_the_janitor(tmp_path: Path) -> None:
    assert janitor_backends() == [kuberay.KubeRay]
    assert kuberay.KubeRay.janitor_index(str(tmp_path)) == Layout(str(tmp_path)).janitor_index("kuberay")
    assert Backend.janitor_index(str(tmp_path)) is None
    assert backend_for(cfg("kuberay")).janitor_scope() == "namespace default"


def test_provision_announces_the_cluster_in_the_backends_words() -> None:
    started = ClusterHandle("http://127.0.0.1:8265", "http://127.0.0.1:8265", True, "python", local=True)
    assert backend_for(cfg("local")).announce(started) == "started local Ray head; dashboard: http://127.0.0.1:8265"
    assert backend_for(cfg("ray-up")).announce(HANDLE) == "brought up Ray cluster (backend ray-up) at http://h:8265"


def test_only_a_local_head_sees_a_job_gone_and_only_when_no_process_of_it_is_left(monkeypatch) -> None:
    """The watchdog's restart need not wait out a few heartbeats when the backend sees the job's processes gone."""
    import subprocess
    import sys

    import psutil

    from control.backends import localhost
    from tests.procs import wait_for

    monkeypatch.setattr(localhost, "host_identity", lambda: {"hostname": "here", "boot_id": "b", "net_ns": "n",
                                                             "pid_ns": "p"})  # fmt: skip
    here = ClusterHandle("http://h:8265", "http://h:8265", True, "python", spec={"host": localhost.host_identity()})
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={"UNBROKEN_SUBMISSION": "sid-live"})  # fmt: skip
    helper = subprocess.Popen(["bash", "-c", "exec -a ray::_AutoscalingCoordinatorActor sleep 60"],
                              env={"UNBROKEN_SUBMISSION": "sid-gone", "PATH": "/usr/bin:/bin"})  # fmt: skip
    try:  # (the helper is bash until its exec: on a loaded machine that can outlast the first look)
        wait_for("the helper's exec", lambda: " ".join(psutil.Process(helper.pid).cmdline()).startswith("ray::"))
        assert backend_for(cfg("local")).job_gone(here, "sid-live") is False, "a process of it is left"
        # Ray's detached helper a job started outlives it and never runs its code: the job is gone
        assert backend_for(cfg("local")).job_gone(here, "sid-gone") is True
        elsewhere = ClusterHandle("http://h:8265", "http://h:8265", True, "python", spec={"host": OTHER_HOST})
        assert backend_for(cfg("local")).job_gone(elsewhere, "sid-gone") is None, "another host: cannot see"
        for name in ("address", "ray-up", "kuberay"):
            assert backend_for(cfg(name)).job_gone(here, "sid-gone") is None
    finally:
        for p in (marked, helper):
            p.kill()
            p.wait()


def test_a_job_whose_processes_this_user_cannot_look_into_is_not_gone(tmp_path) -> None:
    """A watchdog running as another user than the job's (here: ``nobody``, the job's processes root's) cannot read
    their environment, where the job's mark is: that is not seeing the job gone. Unknown: the restart waits out the
    heartbeat instead of resubmitting beside an orphaned driver that trains on."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("needs root and setpriv (util-linux) to look as another user")
    marked = {"UNBROKEN_SUBMISSION": "sid-hidden", "PATH": "/usr/bin:/bin"}
    driver = subprocess.Popen(["bash", "-c", "exec -a 'python -m ray_jobs.job --spec x' sleep 60"], env=marked)
    look = (
        "import sys; from control.backends import backend_for; from control.backends.base import ClusterHandle; "
        "from control.backends.localhost import host_identity; from control.config import load_config; "
        f"cfg = load_config('{DEMO}', ['storage={tmp_path}']); "
        "here = ClusterHandle('http://h:8265', 'http://h:8265', True, 'python', spec={'host': host_identity()}); "
        "print(backend_for(cfg).job_gone(here, sys.argv[1]))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", look]
    try:
        os.chmod(tmp_path, 0o777)
        seen = subprocess.run([*as_nobody, "sid-hidden"], env=env, capture_output=True, text=True, cwd=ROOT)
        assert seen.stdout.strip() == "None", seen.stdout + seen.stderr
        # as the job's own user the same look sees it, and sees another job gone
        mine = subprocess.run([sys.executable, "-c", look, "sid-other"], env=env, capture_output=True, text=True)
        assert mine.stdout.strip() == "True", mine.stdout + mine.stderr
    finally:
        driver.kill()
        driver.wait()


def test_each_registered_backend_is_found_by_its_name() -> None:
    """``backend_class`` finds a backend from its name in the config's ``BackendName`` alone; an unknown name is a
    config error listing the names."""
    for name in BACKENDS:
        assert backend_class(name).name == name
    with pytest.raises(ClusterError, match=r"cluster.backend: unknown backend 'slurm' \(one of: local, address, "):
        backend_class("slurm")
