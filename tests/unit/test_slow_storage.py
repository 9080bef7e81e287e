"""A slow or unavailable store never holds up training: the heartbeat and metrics are written from a side thread
that retries and catches up, and a checkpoint due while the previous write is still in flight is taken once that
write lands, without changing a single weight."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from ray_jobs.train import metrics as metrics_mod
from ray_jobs.train.metrics import MetricsLog, MetricsTail, read_rows
from ray_jobs.train.sidewrite import SideWriter
from tests.unit.test_trainer import checkpoints, named, setup, train, weights_hash  # noqa: F401 (setup: a fixture)


def test_a_side_writer_never_blocks_its_caller_and_lands_the_newest_content_after_failures() -> None:
    gate, written, calls = threading.Event(), [], []
    content = {"v": 0}

    def write() -> None:
        calls.append(content["v"])
        if len(calls) == 1:
            gate.wait(10)  # a request that hangs (a stopped endpoint)
        if len(calls) in (2, 3):
            raise OSError("503 Slow Down")
        written.append(content["v"])

    w = SideWriter(write, "test-writer", retry_s=0.05).start()
    started = time.monotonic()
    for v in range(1, 6):
        content["v"] = v
        w.poke()
    assert time.monotonic() - started < 0.5, "poke returns at once while a write hangs"
    assert not w.flush(0.3), "nothing has landed while the store hangs"
    gate.set()
    assert w.flush(5)
    assert written[-1] == 5 and w.failures == 0
    assert w.close(5)


def test_metrics_logged_while_the_store_fails_land_in_order_once_it_answers(monkeypatch) -> None:
    url = "memory://unbroken-test/runs/r/metrics.jsonl"  # an object store: no appends, whole-file writes
    down = threading.Event()
    real = metrics_mod.write_bytes_atomic

    def flaky(u: str, data: bytes) -> None:
        if down.is_set():
            raise ConnectionError("endpoint unavailable")
        real(u, data)

    monkeypatch.setattr(metrics_mod, "write_bytes_atomic", flaky)
    log = MetricsLog(url, resumed_step=None)
    log.append({"step": 1, "loss": 3.0})
    assert log.flush(5)
    down.set()
    started = time.monotonic()
    for step in range(2, 7):
        log.append({"step": step, "loss": 3.0 - step / 10})
    assert time.monotonic() - started < 0.5, "appending never waits on the store"
    assert not log.flush(0.5)
    down.clear()
    assert log.flush(10)
    assert [r["step"] for r in read_rows(url)] == [1, 2, 3, 4, 5, 6]


def test_a_failed_local_append_is_repaired_by_rewriting_the_file(tmp_path, monkeypatch) -> None:
    url = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(url, resumed_step=None)
    log.append({"step": 1})
    assert log.flush(5)
    real_open, fails = open, [1]

    def half_append(path, mode="r", *a, **k):
        if mode == "a" and fails:  # a partial line, then the disk goes away
            fails.pop()
            with real_open(path, "a") as f:
                f.write('{"step": 2, "lo')
            raise OSError("No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", half_append)
    log.append({"step": 2})
    assert log.flush(10)
    monkeypatch.undo()
    assert [json.loads(line)["step"] for line in Path(url).read_text().splitlines()] == [1, 2]


def test_a_checkpoint_due_while_the_previous_write_is_in_flight_is_deferred_not_waited_for(
    setup,  # noqa: F811 (the fixture imported above)
    monkeypatch,
    caplog,
) -> None:
    from ray_jobs.checkpoint import writer

    cfg, manifest, model = setup
    straight = weights_hash(train(named(cfg, "deferred-straight"), manifest, model))
    c = named(cfg, "deferred")
    real_write, trainer_steps = writer.write_part, []

    def slow_write(part, url):
        if part.step == 10:  # the store hangs on this write until training is well past the next due step
            deadline = time.monotonic() + 60
            while not trainer_steps or trainer_steps[-1] < 25:
                assert time.monotonic() < deadline, "training waited for the write: the steps never came"
                time.sleep(0.01)
        return real_write(part, url)

    from ray_jobs.train import trainer as trainer_mod

    monkeypatch.setattr(writer, "write_part", slow_write)
    real_log = trainer_mod.Trainer.log_row
    monkeypatch.setattr(trainer_mod.Trainer, "log_row", lambda self, row: (trainer_steps.append(row["step"]),
                                                                       real_log(self, row)))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        t = train(c, manifest, model)
    steps = sorted(s for s, _ in checkpoints(c))
    assert 10 in steps and 30 in steps and 20 not in steps, steps
    assert "checkpoint due at step 20 deferred" in caplog.text
    assert weights_hash(t) == straight, "when checkpoints are taken changes no weight"


def _log_steps(log: MetricsLog, steps) -> list[int]:
    """Append and flush one row at a time; the bytes each flush wrote."""
    sizes = []
    for step in steps:
        before = log.bytes_written
        log.append({"step": step, "loss": 1.0 / step, "lr": 0.001})
        assert log.flush(5)
        sizes.append(log.bytes_written - before)
    return sizes


def test_object_store_metrics_cost_o1_bytes_per_logged_step_and_resume_keeps_one_consistent_run() -> None:
    url = "memory://unbroken-test/runs/segments/metrics.jsonl"
    sizes = _log_steps(MetricsLog(url, resumed_step=None), range(1, 401))
    assert max(sizes[300:]) <= 1.2 * max(sizes[:10]), "the 400th step costs what the 1st did (no whole-file rewrite)"
    tail = MetricsTail(url)
    assert [r["step"] for r in tail.poll()] == list(range(1, 401))
    read = tail.bytes_read
    tail.poll()
    assert tail.bytes_read == read, "a look with nothing new reads nothing"
    _log_steps(MetricsLog(url, resumed_step=250), range(251, 261))  # resumed at 250: steps 251.. trained again
    assert [r["step"] for r in tail.poll()] == list(range(1, 261)), "the tail follows the resume"
    assert [r["step"] for r in read_rows(url)] == list(range(1, 261))
    MetricsLog(url, resumed_step=None).flush(5)  # a fresh start: the log is empty again
    assert read_rows(url) == []


def test_a_local_tail_reads_only_appended_bytes_and_follows_a_rewrite(tmp_path) -> None:
    url = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(url, resumed_step=None)
    _log_steps(log, range(1, 51))
    tail = MetricsTail(url)
    assert tail.last_step() == 50
    first = tail.bytes_read
    _log_steps(log, [51])
    assert tail.last_step() == 51 and tail.bytes_read - first < 100
    _log_steps(MetricsLog(url, resumed_step=10), [11])  # a resume rewrites the (shorter) file
    assert [r["step"] for r in tail.poll()] == list(range(1, 12))


def test_a_segment_whose_put_landed_but_failed_is_retried_as_it_was_and_new_rows_follow(monkeypatch) -> None:
    url = "memory://unbroken-test/runs/landed/metrics.jsonl"
    real, failed = metrics_mod.write_bytes_atomic, []

    def lands_then_fails(u: str, data: bytes) -> None:
        real(u, data)
        if not failed and b'"step": 2' in data:  # the PUT landed, the client saw a timeout
            failed.append(u)
            raise TimeoutError("read timed out")

    monkeypatch.setattr(metrics_mod, "write_bytes_atomic", lands_then_fails)
    log = MetricsLog(url, resumed_step=None)
    tail = MetricsTail(url)
    log.append({"step": 1})
    assert log.flush(5)
    log.append({"step": 2})
    time.sleep(0.3)  # the failed write has landed: a reader may see it now
    tail.poll()
    log.append({"step": 3})
    assert log.flush(10) and failed
    assert [r["step"] for r in tail.poll()] == [1, 2, 3], "the tail that read the landed segment misses nothing"
    assert [r["step"] for r in read_rows(url)] == [1, 2, 3]
