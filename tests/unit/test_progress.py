"""Progress of long work (ray_jobs/progress.py): throttled lines, a terminal's bar, the callback; staging's source
bytes (fresh and resumed), the node-cache warm-up and the final export's polled progress. A fake clock: no sleeps."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ray_jobs.data.staging as staging
from ray_jobs.config import DataConfig
from ray_jobs.contracts.dataset import Shard
from ray_jobs.contracts.heartbeat import Beat
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.fingerprint import Source
from ray_jobs.data.read_progress import ReadProgress
from ray_jobs.data.sources import Position
from ray_jobs.model.builtin import train_char_tokenizer
from ray_jobs.progress import Reporter, polled, then
from tests.conftest import SAMPLE_DATA


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _reporter(clock: Clock, **kw) -> tuple[Reporter, list, logging.Logger]:
    said: list = []
    log = logging.getLogger("test.progress")
    r = Reporter("staging", kw.pop("total", 100e6), rates=("tokens",), every=5.0, clock=clock, log=log,
                 on_update=said.append, **{"tty": False, **kw})  # fmt: skip
    return r, said, log


def test_a_line_every_five_seconds_with_percent_rate_and_eta(caplog) -> None:
    clock = Clock()
    r, said, _ = _reporter(clock)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for i in range(101):  # an update every 0.1 s for 10 s: 1 MB and 2,000 tokens each
            clock.t = 100.0 + i / 10
            r.update(i * 1e6, records=i * 10, tokens=i * 2000)
        clock.t += 1
        r.finish()
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == len(said) == 4  # at 0 s, 5 s, 10 s, and the end
    assert lines[0] == "staging: 0% (0 B of 100.0 MB), 0 records"
    assert lines[1] == "staging: 50% (50.0 MB of 100.0 MB), 500 records, 10.0 MB/s, 20,000 tokens/s, ETA 5s"
    assert lines[3] == "staging: 100% (100.0 MB of 100.0 MB), 1,000 records in 11s, 9.1 MB/s, 18,182 tokens/s"
    assert [s.percent for s in said] == [0.0, 50.0, 100.0, 100.0] and said[-1].final
    assert said[1].to_json()["eta_s"] == 5.0 and said[1].to_json()["line"] == lines[1]


def test_rates_count_from_the_first_update_so_a_resumed_staging_is_timed_by_what_it_does_now(caplog) -> None:
    clock = Clock()
    r, said, _ = _reporter(clock)
    r.update(60e6, tokens=9e9)  # resumed at 60 %: what was done before is not this run's speed
    clock.t += 10
    r.update(80e6, tokens=9e9 + 1e6)
    assert said[-1].line() == "staging: 80% (80.0 MB of 100.0 MB), 2.0 MB/s, 100,000 tokens/s, ETA 10s"


def test_quick_work_says_nothing_and_a_failing_callback_never_stops_the_work(caplog) -> None:
    clock = Clock()
    quick, said, _ = _reporter(clock, quiet_s=5.0)
    quick.update(0)
    clock.t += 4
    quick.update(100e6)
    quick.finish()
    assert said == []

    def broken(snap):
        raise OSError("storage said no")

    slow = Reporter("export", 10, "B", every=5.0, clock=clock, on_update=broken, tty=False, log=logging.getLogger("x"))
    with caplog.at_level(logging.INFO, logger="x"):
        slow.update(5)
        slow.finish(10)
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING", "INFO", "WARNING"]
    assert "storage said no" in caplog.records[1].getMessage()


def test_a_terminal_gets_a_bar_redrawn_in_place_then_one_line(caplog) -> None:
    clock, stream = Clock(), io.StringIO()
    r, said, _ = _reporter(clock, tty=True, stream=stream)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for i in range(11):  # every 0.5 s: the bar is redrawn each time, the callback every 5 s
            clock.t = 100.0 + i / 2
            r.update(i * 5e6, tokens=i)
        r.finish(100e6)
    assert (
        stream.getvalue().count("\r") == 12
        and "[############............] 50% (50.0 MB of 100.0 MB)" in stream.getvalue()
    )
    assert len(said) == 3 and [rec.getMessage()[:23] for rec in caplog.records] == ["staging: 100% (100.0 MB"]


def _files(tmp_path: Path) -> list[tuple[str, Source]]:
    (tmp_path / "a.jsonl").write_bytes(b"x" * 100)
    pq.write_table(pa.table({"text": ["r"] * 10}), tmp_path / "b.parquet")
    return [
        ("train", Source(str(tmp_path / n), (tmp_path / n).stat().st_size, "v", "h")) for n in ("a.jsonl", "b.parquet")
    ]


def test_source_bytes_read_from_line_offsets_and_parquet_rows(tmp_path: Path) -> None:
    files = _files(tmp_path)
    got: list = []
    told = ReadProgress(files, lambda done, total, **c: got.append((done, total, c)))
    pq_size = files[1][1].size
    counts = {"records": 7, "train_tokens": 70}
    told(0, Position(40, 5), counts)
    told(0, Position(100, 9), counts, file_done=True)
    told(1, Position(5, 6), counts)
    told(1, Position(10, 11), counts, file_done=True)
    assert got == [
        (d, 100 + pq_size, {"records": 7, "tokens": 70}) for d in (40, 100, 100 + pq_size // 2, 100 + pq_size)
    ]
    ReadProgress(files, None)(0, Position(), counts)  # no callback: nothing to do


def test_staging_reports_its_source_bytes_and_a_resumed_one_starts_where_it_was(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(staging, "BATCH_BYTES", 4000)
    monkeypatch.setattr(staging, "COMMIT_BATCHES", 1)
    data = DataConfig(train=str(SAMPLE_DATA), seq_len=64, work_dir=str(tmp_path / "work"))
    calls: list = []

    def kill_mid_way(done, total, **counts):
        calls.append(done)
        if len(calls) == 20:
            raise KeyboardInterrupt  # as a kill would, mid-read: the spill stays

    with pytest.raises(KeyboardInterrupt):
        staging.stage(data, train_char_tokenizer(), "b", str(tmp_path / "s"), progress=kill_mid_way)
    again: list = []
    staging.stage(data, train_char_tokenizer(), "b", str(tmp_path / "s"), progress=lambda *a, **c: again.append((a, c)))
    total = SAMPLE_DATA.stat().st_size
    assert calls[0] == 0 and calls == sorted(calls)
    assert 0 < again[0][0][0] <= calls[-1], "resumed: its first report is where the spill's progress was"
    assert again[-1][0] == (total, total) and again[-1][1]["records"] == len(SAMPLE_DATA.read_bytes().splitlines())


def test_a_cold_node_cache_warm_up_reports_shards_and_bytes(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("UNBROKEN_PROGRESS_S", "0")  # every update speaks (5 s and after 5 s by default)
    cache = ShardCache(str(tmp_path / "s"), "ds-x", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "rows_path", lambda e, seq_len: tmp_path / e.file)
    entries = [Shard(file=f"train-{i}.parquet", rows=1, bytes=2_000_000, sha256="0" * 64) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="unbroken.cache"):
        assert cache.rows_paths(entries, 64) == [tmp_path / e.file for e in entries]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "node cache warm-up of ds-x: 0% (0 B of 8.0 MB), 0 shards"
    assert lines[2].startswith("node cache warm-up of ds-x: 50% (4.0 MB of 8.0 MB), 2 shards")
    assert lines[-1].startswith("node cache warm-up of ds-x: 100% (8.0 MB of 8.0 MB), 4 shards in 0s")


def test_polled_work_is_read_from_a_thread_until_it_ends(monkeypatch, caplog) -> None:
    clock, done = Clock(), [0]
    r = Reporter("export", 10, "B", every=0.0, clock=clock, tty=False, log=logging.getLogger("x"))
    with caplog.at_level(logging.INFO, logger="x"), polled(r, lambda: done[0], poll_s=0.001):
        done[0] = 10
        clock.t += 1
    assert caplog.records[0].getMessage() == "export: 0% (0 B of 10 B)"
    assert caplog.records[-1].getMessage() == "export: 100% (10 B of 10 B) in 1s, 10 B/s"


def test_a_sync_wait_for_a_job_polls_the_hook_in_the_callers_context(monkeypatch) -> None:
    """Staging on the cluster waits with ``run_to_end`` and reads the job's progress file from its ``on_poll``; from
    inside a running loop (the async finetune flow) that runs in a helper thread, in the task run's context (its
    logger, the artifact's run)."""
    import asyncio
    import contextvars

    from control import jobs
    from control.backends.base import ClusterHandle
    from control.jobsapi import JobView

    views = iter([JobView("ok", "RUNNING"), JobView("ok", "RUNNING"), JobView("ok", "SUCCEEDED")])
    monkeypatch.setattr(jobs.jobsapi, "read_job", lambda *a, **k: next(views))
    monkeypatch.setattr(jobs, "STATUS_POLL_S", 0.001)
    monkeypatch.setattr(jobs.LogForwarder, "follow", lambda self: asyncio.sleep(0))
    monkeypatch.setattr(jobs.jobsapi, "job_logs", lambda *a, **k: None)
    run = contextvars.ContextVar("run", default=None)
    polled_in: list = []

    async def on_poll(status: str) -> None:
        polled_in.append((status, run.get()))

    async def a_task_in_an_async_flow() -> str:
        run.set("task-run-1")
        handle = ClusterHandle("http://127.0.0.1:1", "http://127.0.0.1:1", False, "python")
        return jobs.run_to_end(handle, "unbroken-stage-1", poll_s=0.001, on_poll=on_poll)

    assert asyncio.run(a_task_in_an_async_flow()) == "SUCCEEDED"
    assert polled_in == [("RUNNING", "task-run-1"), ("RUNNING", "task-run-1"), ("SUCCEEDED", "task-run-1")]


def test_a_next_phase_speaks_only_after_the_one_before_said_its_last_line(caplog) -> None:
    clock = Clock()
    log = logging.getLogger("phases")
    read = Reporter("staging", 10, "B", every=0.0, clock=clock, tty=False, log=log)
    write = Reporter("writing shards", 4, "rows", every=0.0, clock=clock, tty=False, log=log)
    with caplog.at_level(logging.INFO, logger="phases"):
        read.update(10)
        step = then(read, write)
        step(2, 4)
        step(4, 4)
        read.finish()  # finished already: not said twice
        write.finish()
    said = [r.getMessage().split(":")[0] for r in caplog.records]
    assert said == ["staging", "staging", "writing shards", "writing shards", "writing shards"]


# The training's progress in the flow's watch (control/progress.py) ----------------------------------------------

BEAT = {"pid": 11, "started_step": 0, "step": 0, "phase": "training"}


def as_beat(fields: dict) -> Beat:
    """A heartbeat with these fields (the rest any job writes, at their least)."""
    return Beat.model_validate({"run": "p", "attempt": 1, "time": 0.0, "max_steps": 100, "last_step_at": 0.0} | fields)


@pytest.mark.parametrize(
    ("before", "now", "said"),
    [
        (None, BEAT, None),  # the first beat seen
        (BEAT | {"step": 40}, BEAT | {"step": 60}, None),  # the same process, further on
        (BEAT | {"step": 812}, BEAT | {"step": 812, "phase": "restarting"},
         "a worker failed at step 812: Ray Train restarts the worker group"),
        (BEAT | {"step": 812, "phase": "restarting"}, BEAT | {"step": 812, "phase": "restarting"}, None),  # said once
        (BEAT | {"step": 812, "phase": "restarting"}, {"pid": 12, "started_step": 750, "step": 751, "phase": "training"},
         "resumed from step 750 (62 steps to train again)"),
        # a new process beats from its start, before it knows its resume step: nothing said until it trains
        (BEAT | {"step": 812, "phase": "restarting"}, {"pid": 12, "started_step": 0, "step": 0, "phase": "loading"},
         None),
        # a kill the heartbeat never showed as restarting (the driver restarted by the watchdog, say)
        (BEAT | {"step": 25}, {"pid": 13, "started_step": 20, "step": 21, "phase": "training"},
         "resumed from step 20 (5 steps to train again)"),
    ],
)  # fmt: skip
def test_a_restart_is_said_as_it_happens(before, now, said) -> None:
    from control.progress import Stint, restart_line

    assert restart_line(None if before is None else Stint.of(as_beat(before)), Stint.of(as_beat(now))) == said


def test_the_watch_shows_step_loss_tokens_time_and_eta_and_a_restart(tmp_path: Path, caplog, monkeypatch) -> None:
    import json

    from control.progress import TrainingProgress
    from ray_jobs.config import load_config
    from tests.conftest import ROOT

    monkeypatch.delenv("UNBROKEN_PROGRESS_S", raising=False)
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", "name=p", "train.max_steps=100"])
    metrics = tmp_path / "runs" / "p" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    clock, log = Clock(), logging.getLogger("test.training")
    shown = TrainingProgress(cfg, log, stream=io.StringIO(), clock=clock)

    def logged(step: int, loss: float, at: float) -> None:
        with metrics.open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "tokens_seen": step * 1000}) + "\n")
        clock.t = at

    with caplog.at_level(logging.INFO, logger="test.training"):
        assert shown.poll(None) == (0, 100)  # nothing trained yet: nothing said
        logged(10, 2.5, 110.0)
        shown.poll(as_beat(BEAT | {"step": 10}))
        logged(40, 1.25, 140.0)  # 30 steps in 30 s
        assert shown.poll(as_beat(BEAT | {"step": 40})) == (40, 100)
        shown.poll(as_beat(BEAT | {"step": 40, "phase": "restarting"}))
        shown.poll(as_beat({"pid": 12, "started_step": 0, "step": 0, "phase": "loading"}))  # the new rank 0, loading
        logged(31, 1.5, 200.0)  # resumed from step 30 by the new process
        shown.poll(as_beat({"pid": 12, "started_step": 30, "step": 31, "phase": "training"}))
        logged(100, 0.5, 269.0)
        shown.poll(as_beat({"pid": 12, "started_step": 30, "step": 100, "phase": "training"}))
        shown.close(done=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "training: 10% (10 steps of 100 steps), loss 2.5000, 10s so far",
        "training: 40% (40 steps of 100 steps), loss 1.2500, 40s so far, 1 steps/s, 1,000 tokens/s, ETA 1m00s",
        "a worker failed at step 40: Ray Train restarts the worker group",
        "resumed from step 30 (10 steps to train again)",  # the rate and ETA count again from here
        "training: 31% (31 steps of 100 steps), loss 1.5000, 1m40s so far",
        "training: 100% (100 steps of 100 steps), loss 0.5000, 2m49s so far, 1 steps/s, 1,000 tokens/s, ETA 0s",
        "training: 100% (100 steps of 100 steps), loss 0.5000, 2m49s so far in 1m09s, 1 steps/s, 1,000 tokens/s",
    ], lines
