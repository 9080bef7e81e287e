"""Cluster health as the watchdog sees it: the dashboard's node summary (shape recorded from Ray 2.60's dashboard)
read into nodes, and every kind of finding named with its node and numbers; the watchdog notes each once and clears
it when it no longer holds, never restarting a running job for it."""

from __future__ import annotations

import copy

from control.backends import backend_class, health
from control.backends.health import Health
from control.describe import _incident_line
from control.records.run import Attempt, ClusterRecord, RunRecord
from control.watchdog import act
from control.watchdog.decision import ReplaceNodes
from control.watchdog.notes import note_health
from control.watchdog.observe import Observations
from ray_jobs.config import load_config
from tests.conftest import ROOT

GIB = 1024**3


def summary_node(ip: str, head: bool = False, state: str = "ALIVE", gpus: int = 0, visible: int | None = None,
                 store_used: int = 5239, disk_free: int = 77 * GIB) -> dict:  # fmt: skip
    """One node of ``GET /nodes?view=summary`` as Ray 2.60's dashboard answers (the fields read; others dropped)."""
    total = {"CPU": 1.0, "objectStoreMemory": 7.0 * GIB, "memory": 16.0 * GIB} | ({"GPU": float(gpus)} if gpus else {})
    return {
        "hostname": "vm", "ip": ip, "now": 1795452774.5,
        "raylet": {"objectStoreUsedMemory": store_used, "objectStoreAvailableMemory": int(7 * GIB) - store_used,
                   "nodeId": ip.replace(".", "") * 4, "nodeManagerAddress": ip, "resourcesTotal": total,
                   "isHeadNode": head, "state": state},
        "disk": {"/": {"total": 252 * GIB, "used": 29 * GIB, "free": disk_free, "percent": 28.5},
                 f"/tmp/ray/{ip}": {"total": 252 * GIB, "used": 29 * GIB, "free": disk_free, "percent": 28.5}},
        "gpus": [{"index": i, "name": "NVIDIA H100"} for i in range(gpus if visible is None else visible)],
    }  # fmt: skip


def body(*nodes: dict) -> dict:
    return {
        "result": True,
        "msg": "Node summary fetched.",
        "data": {"summary": list(nodes), "nodeLogicalResources": {}},
    }


def cfg(*overrides: str):
    return load_config(ROOT / "configs" / "demo.yaml", ["storage=s3://bucket/x", *overrides])


def test_the_summary_is_read_into_nodes() -> None:
    nodes = health.parse_summary(body(summary_node("10.0.0.10", head=True), summary_node("10.0.0.11", gpus=2)))
    head, worker = nodes
    assert head.head and head.alive and head.gpus == 0 and head.gpus_visible is None
    assert worker.gpus == 2 and worker.gpus_visible == 2 and worker.store_total == int(7 * GIB)
    assert worker.disks["/"] == (77 * GIB, 252 * GIB)


def test_a_healthy_cluster_has_no_findings() -> None:
    h = Health(health.parse_summary(body(summary_node("10.0.0.10", head=True), summary_node("10.0.0.11"))))
    assert health.assess(h, cfg(), expected_nodes=2) == []


def test_every_kind_of_trouble_is_named_with_its_node_and_numbers() -> None:
    h = Health(health.parse_summary(body(
        summary_node("10.0.0.10", head=True),
        summary_node("10.0.0.11", gpus=2, visible=1),  # a GPU fell off the bus
        summary_node("10.0.0.12", store_used=int(6.5 * GIB)),  # 93 % of its object store
        summary_node("10.0.0.13", disk_free=GIB // 2),  # half a GiB left
        summary_node("10.0.0.14", state="DEAD"),
        summary_node("10.0.0.11", state="DEAD"),  # an earlier node of a host that came back: not missing
    )))  # fmt: skip
    found = health.assess(h, cfg("cluster.use_gpu=true", "cluster.num_workers=4"), expected_nodes=5,
                          storage=(GIB, 100 * GIB))  # fmt: skip
    text = "\n".join(f.key() for f in found)
    assert "nodes-missing: 4 of 5 nodes alive (dead: 10.0.0.14)" in text
    assert "gpus-missing: the cluster has 2 GPUs; cluster.num_workers needs at least 4" in text
    assert "gpus-missing: node 10.0.0.11 gives Ray 2 GPUs but only 1 are visible" in text
    assert "object-store-full: node 10.0.0.12: object store 93% used (6.5 GiB of 7.0 GiB)" in text
    assert "disk-low: node 10.0.0.13: / has 0.5 GiB free of 252.0 GiB" in text
    assert "disk-low: storage s3://bucket/x has 1.0 GiB free of 100.0 GiB" in text
    assert {f.kind for f in found} == {"nodes-missing", "gpus-missing", "object-store-full", "disk-low"}


def a_run(backend: str = "local") -> RunRecord:
    return RunRecord(
        name="r",
        cluster=ClusterRecord(address="http://head:8265", backend=backend),
        attempts=[Attempt(attempt=1, submission_id="s", started_at=0.0, started_by="finetune-flow")],
    )


def look(reg: RunRecord, now: float, h: Health) -> tuple[bool, list[str]]:
    """The watchdog's health judgement for one pass (decide's ``note_health``): (record changed, findings)."""
    changed, found, _ = note_health(reg, cfg(), Observations(now, health=h))
    return changed, found


def test_the_watchdog_notes_a_finding_once_and_clears_it_never_restarting_for_it() -> None:
    reg = a_run()
    three = body(summary_node("10.0.0.10", head=True), summary_node("10.0.0.11"), summary_node("10.0.0.12"))
    one_dead = copy.deepcopy(three)
    one_dead["data"]["summary"][2]["raylet"]["state"] = "DEAD"
    seen = iter([three, one_dead, one_dead, three])

    def read() -> Health:
        return Health(health.parse_summary(next(seen)))

    assert look(reg, 1.0, read()) == (True, [])  # learns the shape: 3 nodes
    changed, found = look(reg, 2.0, read())
    assert changed and found == ["nodes-missing: 2 of 3 nodes alive (dead: 10.0.0.12)"]
    assert look(reg, 3.0, read()) == (False, found), "noted once, not again"
    (incident,) = reg.incidents
    assert incident.kind == "nodes-missing" and incident.action == "noted"
    assert reg.open_incident() is None, "a note is never a restart"
    assert "nodes-missing (attempt 1, by watchdog (cluster health)): noted, still holds" in _incident_line(incident)
    assert look(reg, 4.0, read()) == (True, []) and incident.cleared_at == 4.0
    assert look(reg, 5.0, Health(None, "ReadTimeout")) == (False, [])


def test_a_dashboard_that_cannot_be_read_concludes_nothing() -> None:
    h = health.read("http://127.0.0.1:9", timeout_s=2)
    assert h.nodes is None and h.why


def test_a_missing_node_of_a_ray_up_cluster_is_asked_back_through_its_backend(monkeypatch) -> None:
    """On-prem ``ray up``: a lost worker host is the launcher's to bring back (``up``, Ray not restarted); the
    watchdog asks once per incident and notes what happened. Other backends only note it."""
    asked = []

    def backend(name: str):
        class Backend(backend_class(name)):
            def up(self, run=None):
                asked.append(run)

        return Backend(c)

    c = cfg()
    two = body(summary_node("10.0.0.10", head=True), summary_node("10.0.0.11"))
    one = copy.deepcopy(two)
    one["data"]["summary"][1]["raylet"]["state"] = "DEAD"
    for name, want in (("ray-up", [c.name]), ("address", [])):
        asked.clear()
        monkeypatch.setattr(act, "backend_for", lambda cfg, name=name: backend(name))
        reg = a_run(name)
        for t, summary in ((1.0, two), (2.0, one), (3.0, one)):
            _, _, actions = note_health(reg, c, Observations(t, health=Health(health.parse_summary(summary))))
            for a in actions:
                if isinstance(a, ReplaceNodes):
                    act.act(act.Decision(reg, [a], act.Outcome("r", "ok")), c, None)
        assert asked == want, name
        (incident,) = reg.incidents
        assert incident.repair == ("ray-up up: replacement nodes requested" if want else None)
