"""Whose head, on which host: a local head's run is judged only from the host it runs on (127.0.0.1 elsewhere leads to
another machine's loopback), and a run never submits into a head started for other runs (another checkout,
interpreter or environment) -- it says so in one line naming the ports. Tables over recorded identities; no head."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from control import lease as leases
from control import registry
from control.backends import localhost
from control.backends.localhost import HeadMismatch, check_identity, elsewhere, head_identity, host_identity
from control.records.run import Attempt, ClusterRecord, RunRecord
from control.watchdog import check_run
from ray_jobs.config import load_config
from tests.conftest import ROOT

HERE = host_identity()


def cfg(tmp_path: Path, *extra: str):
    return load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "name=r", *extra])


@pytest.mark.parametrize(
    ("there", "refused"),
    [
        ({}, None),  # a record from before hosts were recorded: this host's
        (HERE, None),
        (HERE | {"hostname": "renamed"}, None),  # the name is for people; the boot and namespaces decide
        (HERE | {"boot_id": "another-boot"}, "boot_id"),  # another machine (or this one rebooted)
        (HERE | {"net_ns": "net:[1]"}, "net_ns"),  # another network namespace: another 127.0.0.1
        (HERE | {"pid_ns": "pid:[1]"}, "pid_ns"),  # its processes cannot be signalled from here
    ],
)
def test_a_local_head_is_judged_only_from_its_own_host(there: dict, refused: str | None) -> None:
    why = elsewhere({"host": there})
    assert (why is None) == (refused is None), why
    if refused:
        assert refused in why and "left to a watchdog on that host" in why


def test_a_watchdog_on_another_host_leaves_a_local_heads_run_alone_and_says_why_once(tmp_path: Path, caplog) -> None:
    c = cfg(tmp_path)
    spec = {"head_port": 6379, "dashboard_port": 8265, "host": HERE | {"net_ns": "net:[4242]", "hostname": "box-a"}}
    reg = RunRecord(name="r", state="running", config=json.loads(c.model_dump_json()),
                    cluster=ClusterRecord(address="http://127.0.0.1:8265", backend="local", spec=spec, mode="local"),
                    attempts=[Attempt(attempt=1, submission_id="s", started_at=time.time() - 3600,
                                      started_by="finetune-flow", status="RUNNING")])  # fmt: skip
    registry.save(str(tmp_path), "r", reg)
    before = Path(registry.Layout(str(tmp_path)).run_registry("r")).read_bytes()
    with caplog.at_level("WARNING"):
        outcomes = [check_run(str(tmp_path), "r") for _ in range(3)]
    assert {o.action for o in outcomes} == {"elsewhere"} and "box-a" in outcomes[0].detail
    assert sum("box-a" in r.getMessage() for r in caplog.records) == 1, "said once, not every pass"
    assert Path(registry.Layout(str(tmp_path)).run_registry("r")).read_bytes() == before, "nothing written"
    assert leases.holder(str(tmp_path), "r") is None and not Path(tmp_path, "runs", "r", "leases").exists()


def _started_with(tmp_path: Path, monkeypatch, c, session: str = "session_1", **changes) -> None:
    monkeypatch.setattr(localhost, "HEADS_DIR", tmp_path / "heads")
    (tmp_path / "heads" / str(c.cluster.dashboard_port)).mkdir(parents=True)
    identity = head_identity(c) | {"session": session} | changes
    (tmp_path / "heads" / str(c.cluster.dashboard_port) / localhost.IDENTITY).write_text(json.dumps(identity))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({}, None),
        ({"interpreter": "/other/checkout/.venv/bin/python3.11"}, "interpreter '/other/checkout/.venv/bin/python3.11'"),
        ({"project": "/other/checkout"}, "project checkout '/other/checkout'"),
        ({"version": "0.0.9"}, "unbroken version '0.0.9'"),
        (
            {"env_passthrough": ["AWS_PROFILE", "HF_TOKEN"]},
            "cluster.env_passthrough (only the head's: ['HF_TOKEN'], only this run's: ['AWS_ACCESS_KEY_ID', ",
        ),
        ({"env_digest": "0" * 16}, "values of cluster.env_passthrough"),  # e.g. no S3 credentials when it started
    ],
)
def test_a_head_started_for_other_runs_is_refused_in_one_line_naming_the_ports(
    tmp_path: Path, monkeypatch, changes: dict, named: str | None
) -> None:
    c = cfg(tmp_path, "cluster.dashboard_port=8499", "cluster.head_port=6499")
    _started_with(tmp_path, monkeypatch, c, **changes)
    if named is None:
        check_identity(c, "session_1")
        return
    with pytest.raises(HeadMismatch) as refused:
        check_identity(c, "session_1")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("cluster.dashboard_port=8499, cluster.head_port=6499: ")
    assert named in message


def test_a_head_unbroken_did_not_start_or_an_earlier_heads_record_is_refused(tmp_path: Path, monkeypatch) -> None:
    c = cfg(tmp_path, "cluster.dashboard_port=8498")
    monkeypatch.setattr(localhost, "HEADS_DIR", tmp_path / "none")
    with pytest.raises(HeadMismatch, match="a Ray head that unbroken did not start answers on these ports"):
        check_identity(c, "session_2")  # `ray start` by hand: no record at all
    _started_with(tmp_path, monkeypatch, c, session="session_1")
    with pytest.raises(HeadMismatch, match="did not start"):
        check_identity(c, "session_2")  # the record is an earlier head's on this port, not the one answering


def test_a_refused_head_is_a_config_error_the_command_line_prints_as_one_line(tmp_path: Path, monkeypatch) -> None:
    from control.backends import local
    from unbroken import cli

    def refuse(cfg) -> None:
        raise HeadMismatch("cluster.dashboard_port=8265, cluster.head_port=6379: started with another interpreter")

    monkeypatch.setattr(local, "check_head", refuse)
    code = cli.main(["run", str(ROOT / "configs" / "demo.yaml"), "--set", f"storage={tmp_path}"])
    assert code == 2
