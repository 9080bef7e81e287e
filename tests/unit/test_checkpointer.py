"""The checkpointer on its own (no model): when a checkpoint is taken, committed, deferred or abandoned."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ray_jobs import checkpoint as ckpt
from ray_jobs.checkpoint import Checkpointer, writer
from ray_jobs.config import load_config
from tests.conftest import ROOT, tiny_overrides


class OneRank:
    """Rank 0 of 1: collectives are identities; what was reported to Ray is kept."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.reports: list[tuple[dict[str, Any], str | None]] = []

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def report(self, metrics: dict[str, Any], checkpoint_url: str | None) -> None:
        self.reports.append((metrics, checkpoint_url))


def checkpointer(tmp_path: Path, **sets: Any) -> tuple[Checkpointer, OneRank, list[str], dict[str, int]]:
    """A checkpointer whose snapshot is a ``state.json`` of the step in ``at['now']`` (the test moves it)."""
    overrides = [*tiny_overrides(tmp_path), *(f"checkpoint.{k}={v}" for k, v in sets.items())]
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    rt, phases = OneRank(), []
    at = {"now": 0}

    def snapshot() -> ckpt.Part:
        return ckpt.Part(at["now"], {ckpt.STATE_FILE: ("json", {"step": at["now"]})})

    return Checkpointer(cfg, rt, str(tmp_path / "ckpts"), snapshot, phases.append), rt, phases, at


def test_a_checkpoint_is_taken_every_n_steps_and_reported_once_its_manifest_landed(tmp_path) -> None:
    c, rt, _, at = checkpointer(tmp_path, every_steps=2)
    for step in (1, 2):
        at["now"] = step
        assert (c.save_if_due(step, last=False, time_due=False, metrics={"step": step}) is None) == (step == 1)
    c.commit()
    assert rt.reports == [({"step": 2}, c.url(2))]
    assert ckpt.read_manifest(c.url(2)).step == 2
    c.writer.close()


def test_a_due_checkpoint_waits_while_the_previous_write_is_in_flight_and_is_taken_after(tmp_path, monkeypatch) -> None:
    c, rt, _, at = checkpointer(tmp_path, every_steps=1)
    release = threading.Event()
    real = writer.write_part
    monkeypatch.setattr(writer, "write_part", lambda part, url: release.wait(10) and real(part, url))
    at["now"] = 1
    assert c.save_if_due(1, last=False, time_due=False, metrics={}) is not None
    at["now"] = 2
    assert c.save_if_due(2, last=False, time_due=False, metrics={}) is None and c.owed, "deferred, not waited for"
    release.set()
    c.commit()
    at["now"] = 3
    assert c.save_if_due(3, last=False, time_due=False, metrics={}) is not None and not c.owed
    c.finish(3, {})
    assert [url for _, url in rt.reports] == [c.url(1), c.url(3)]


def test_a_failed_write_is_abandoned_and_the_next_step_takes_one(tmp_path, monkeypatch, caplog) -> None:
    c, rt, _, at = checkpointer(tmp_path, every_steps=10)

    def refused(part, url):
        raise ConnectionError("the store refused the PUT")

    monkeypatch.setattr(writer, "write_part", refused)
    at["now"] = 10
    c.save(10, {}, sync=True)
    assert c.pending is None and c.owed and rt.reports == []
    assert "checkpoint for step 10 abandoned" in caplog.text


def test_a_synchronous_checkpoint_is_its_own_phase_and_the_final_one_fails_the_attempt_if_refused(
    tmp_path, monkeypatch
) -> None:
    c, _, phases, at = checkpointer(tmp_path)
    monkeypatch.setattr(writer, "write_part", lambda part, url: (_ for _ in ()).throw(OSError("gone")))
    at["now"] = 5
    try:
        c.finish(5, {})
    except RuntimeError as e:
        assert "the final checkpoint (step 5) could not be written" in str(e)
    else:
        raise AssertionError("a final checkpoint that was not written must fail the attempt")
    assert phases == ["checkpointing", "training"]
