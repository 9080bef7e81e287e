"""Live recovery without Ray (torchft replicas as plain processes, a lighthouse in this process): a replica killed
with SIGKILL mid-run and started again ends the run with the weights, the rows and the eval loss of an ordinary
two-worker DDP run, bit for bit -- the survivor computed the lost replica's share of every step it missed, and the
newcomer healed from it, not from storage. What cannot run live is refused by name. (The same on Ray Train, with
kill -9 and SIGTERM of real workers: tests/chaos/test_live_recovery.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from ray_jobs.config import Config, ConfigError, load_config
from ray_jobs.config.model import LoraConfig
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.train.live import Retries, StepStuck, shares_of, virtual_slots
from ray_jobs.train.rowtrace import ENV, trained_rows
from tests.conftest import ROOT, tiny_overrides
from tests.unit.dist_runs import lighthouse, run_world, start_live, train_rank

DEMO = ROOT / "configs" / "demo.yaml"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["train.parallelism=fsdp"], "needs train.parallelism=ddp"),
        (["cluster.num_workers={min: 1, max: 2}"], "needs a fixed cluster.num_workers, not {min: 1, max: 2}"),
        (["cluster.num_workers=1"], "needs cluster.num_workers >= 2"),
        (["checkpoint.keep_best_by=eval_loss"], "keeps the newest checkpoints only: unset checkpoint.keep_best_by"),
    ],
)
def test_what_cannot_run_live_is_refused_by_name_before_any_cluster_work(overrides, says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["fault_tolerance.live_recovery=true", *overrides])
    assert "fault_tolerance.live_recovery: " + says in str(e.value)


def test_a_standby_without_live_recovery_is_refused_by_name(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["fault_tolerance.standby_replicas=1"])
    assert "fault_tolerance.standby_replicas: needs fault_tolerance.live_recovery=true" in str(e.value)
    from unbroken.cli import main

    assert main(["train", str(DEMO), "--local", "--set", "fault_tolerance.standby_replicas=1",
                 "--set", f"storage={tmp_path}"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert (
        err.startswith("error: invalid ")
        and "- fault_tolerance.standby_replicas: needs" in err
        and len(err.splitlines()) == 2
    )


@pytest.mark.parametrize(
    ("participants", "replicas", "shares"),
    [
        (2, 2, [[0], [1]]),  # all there: each its own share
        (1, 2, [[0, 1]]),  # one lost: the survivor computes both, in order
        (2, 4, [[0, 2], [1, 3]]),
        (3, 4, [[0, 3], [1], [2]]),
    ],
)
def test_every_share_of_a_step_is_computed_exactly_once_whoever_is_missing(participants, replicas, shares) -> None:
    assert [shares_of(p, participants, replicas) for p in range(participants)] == shares
    assert virtual_slots(2, 3, [0, 1]) == [[0, 1, 2], [3, 4, 5]]  # worker j's micro-batches in an ordinary run


def _trace(folder: Path, rank: int, *lines: tuple) -> None:
    """A replica's row-trace lines: ("computed", step, rows) before its share is summed, ("committed", step,
    participants) once the step committed -- as live_trainer writes them (ray_jobs/train/rowtrace.py)."""
    from ray_jobs.train.rowtrace import RowTrace

    t = RowTrace(str(folder), 7, rank, 2)
    for kind, step, what in lines:
        if kind == "computed":
            t.rows = [[0, f"train-0000{rank}.parquet", r] for r in what]
            t.computed(step)
        else:
            t.committed(step, what)


@pytest.mark.parametrize(
    ("replica_0", "replica_1", "trained"),
    [
        # both took part in step 1: each one's share
        ([("computed", 1, [0]), ("committed", 1, [0, 1])], [("computed", 1, [5]), ("committed", 1, [0, 1])],
         {(0, 0), (1, 5)}),
        # replica 1 killed after its share was summed, before it saw the commit: its rows counted all the same
        ([("computed", 1, [0]), ("committed", 1, [0, 1])], [("computed", 1, [5])], {(0, 0), (1, 5)}),
        # replica 1 killed before the sum: the step did not commit with it; replica 0 computed it again, both shares
        ([("computed", 1, [0]), ("computed", 1, [0, 5]), ("committed", 1, [0])], [("computed", 1, [5])],
         {(0, 0), (0, 5)}),
        # a step nobody committed (the run ended on it): none of its rows
        ([("computed", 1, [0]), ("committed", 1, [0, 1]), ("computed", 2, [1])], [("computed", 1, [5])],
         {(0, 0), (1, 5)}),
    ],
)  # fmt: skip
def test_a_live_steps_rows_are_the_shares_of_those_who_took_part_in_its_commit(
    tmp_path, replica_0, replica_1, trained
) -> None:
    _trace(tmp_path, 0, *replica_0)
    _trace(tmp_path, 1, *replica_1)
    rows, _ = trained_rows(tmp_path)
    assert set(rows) == {(0, f"train-0000{rank}.parquet", r) for rank, r in trained}
    assert all(n == 1 for n in rows.values())


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("live") / "storage"
    overrides = {"train.lr": 0.01, "train.warmup_steps": 3, "cluster.num_workers": 2, "cluster.cpus_per_worker": 1,
                 "train.max_steps": 40, "checkpoint.every_steps": 10, "model.tiny.num_layers": 2,
                 "data.min_shards": 6}  # fmt: skip
    cfg = load_config(DEMO, tiny_overrides(storage, **overrides))
    model = str(storage.parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    return cfg, stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


@pytest.fixture(scope="module")
def ddp_runs(setup, tmp_path_factory):
    """The ordinary two-worker DDP run of a variant (its result and row-trace folder), run once per module."""
    cfg, manifest, model = setup
    done: dict[str, tuple[dict, object]] = {}

    def run(kind: str, variant: Config):
        if kind not in done:
            trace = tmp_path_factory.mktemp(f"ddp-{kind}")
            with pytest.MonkeyPatch.context() as mp_:
                mp_.setenv(ENV, str(trace))
                ddp = run_world(
                    train_rank, 2, variant.model_copy(update={"name": f"ddp-{kind}"}), manifest, model, None
                )
            done[kind] = (ddp[0], trace)
        return done[kind]

    return run


def kill_and_replace(
    live: Config, manifest: dict, model: str, trace, heal_fails: bool = False, workers: int = 2
) -> dict:
    """``workers`` live replicas; replica 1 killed (SIGKILL) at step 12 and started again once replica 0 trained
    step 14 without it (as Ray Train takes a while to notice and replace it); every replica's result. The survivors
    wait before step HOLD_AT until the replacement has asked to join (``dist_runs._gate``)."""
    house = lighthouse(live)
    trace.mkdir(parents=True, exist_ok=True)
    hold, asked = trace / "hold", trace / "asked"
    hold.touch()
    with mp.Manager() as m:
        out = m.dict()
        replicas = [start_live(r, workers, house.address(), live, manifest, model, out, gate=(str(hold), None))
                    for r in range(workers)]  # fmt: skip
        wait_for(lambda: any('"step": 12,' in p.read_text() for p in trace.glob("rows-*-1.jsonl")), replicas[1])
        replicas[1].kill()  # SIGKILL
        replicas[1].join()
        wait_for(lambda: any('"step": 14,' in p.read_text() for p in trace.glob("rows-*-0.jsonl")), replicas[0])
        replicas[1] = start_live(
            1, workers, house.address(), live, manifest, model, out, heal_fails, (None, str(asked))
        )
        wait_for(asked.exists, replicas[1])
        hold.unlink()
        for p in replicas:
            p.join(timeout=120)
        results = dict(out) | {"exitcodes": [p.exitcode for p in replicas]}
    house.shutdown()
    return results


def wait_for(ready, replica) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        assert time.monotonic() < deadline and replica.is_alive(), f"{replica.name}: never got there"
        time.sleep(0.02)


def logged_steps(cfg: Config) -> list[int]:
    """The steps of a run's metrics log, in order."""
    log = Path(cfg.storage) / "runs" / cfg.name / "metrics.jsonl"
    return [json.loads(ln)["step"] for ln in log.read_text().splitlines()]


def live_variant(cfg: Config, name: str, monkeypatch, trace, **ft) -> Config:
    live = cfg.model_copy(deep=True)
    live.name, live.fault_tolerance.live_recovery = name, True
    for k, v in ft.items():
        setattr(live.fault_tolerance, k, v)
    monkeypatch.setenv(ENV, str(trace))
    monkeypatch.setenv("UNBROKEN_INJECT_DELAY", "step:0.1")  # long enough for a newcomer to join mid-run
    return live


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_replica_killed_mid_run_is_healed_from_its_peer_and_the_run_ends_as_ddp_does(
    setup, ddp_runs, lora, tmp_path, monkeypatch
) -> None:
    cfg, manifest, model = setup
    cfg = cfg.model_copy(deep=True)
    if lora:  # the adapters only cross to the newcomer (the base weights are its own, from the same folder)
        cfg.model.lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    kind = "lora" if lora else "full"
    ddp, ddp_trace = ddp_runs(kind, cfg)
    live = live_variant(cfg, f"live-{kind}", monkeypatch, tmp_path / "live")
    results = kill_and_replace(live, manifest, model, tmp_path / "live")

    assert results["exitcodes"] == [0, 0]
    assert results[0]["weights"] == results[1]["weights"] == ddp["weights"], "bit-identical to the DDP run"
    assert results[0]["eval_loss"] == results[1]["eval_loss"] == ddp["eval_loss"]
    assert results[1]["resumed_from"] == "a live peer", "the newcomer healed from replica 0, not from storage"
    # Who leads at the end depends on timing: replica 0 takes the lead when it commits a step without a lost leader;
    # a replacement back before that inherits it. Either way every replica agrees, and the log has each row once.
    assert results[0]["leader"] == results[1]["leader"] is not None, "every replica knows who leads"
    assert logged_steps(live) == logged_steps(cfg.model_copy(update={"name": f"ddp-{kind}"})), "each row once"
    want, _ = trained_rows(ddp_trace)
    got, _ = trained_rows(tmp_path / "live")
    assert got == want and sum(got.values()) == 40 * 2 * cfg.train.micro_batch_size


def test_a_replica_whose_heal_keeps_failing_leaves_with_the_cause_and_the_survivor_finishes(
    setup, ddp_runs, tmp_path, monkeypatch
) -> None:
    cfg, manifest, model = setup
    ddp, ddp_trace = ddp_runs("full", cfg)
    live = live_variant(cfg, "live-heal-fails", monkeypatch, tmp_path / "live", replica_timeout_s=0.5)
    results = kill_and_replace(live, manifest, model, tmp_path / "live", heal_fails=True)

    assert results["exitcodes"][1] != 0, "the newcomer that cannot heal does not retry forever"
    error = results[1]["error"]
    assert error.startswith("StepStuck: replica 1: step ") and "(its heal from a live peer failed)" in error
    assert "ConnectionError: injected: the heal's transfer broke" in error, "the log names the heal's own failure"
    assert results["exitcodes"][0] == 0 and results[0]["step"] == 40
    assert results[0]["weights"] == ddp["weights"], "the survivor computed every share alone: DDP's bits"
    got, _ = trained_rows(tmp_path / "live")
    want, _ = trained_rows(ddp_trace)
    assert got == want, "no row of a failed try was applied"


def test_with_a_standby_a_lost_worker_costs_no_step_trained_short_handed(setup, ddp_runs, tmp_path, monkeypatch):
    cfg, manifest, model = setup
    ddp, ddp_trace = ddp_runs("full", cfg)
    live = live_variant(cfg, "live-standby", monkeypatch, tmp_path / "live", standby_replicas=1)
    live.train.log_every_steps = 1  # every step's participants in the metrics log
    results = kill_and_replace(live, manifest, model, tmp_path / "live", workers=3)

    assert results["exitcodes"] == [0, 0, 0]
    assert results[0]["weights"] == results[1]["weights"] == results[2]["weights"] == ddp["weights"], "DDP's bits"
    got, _ = trained_rows(tmp_path / "live")
    want, _ = trained_rows(ddp_trace)
    assert got == want, "every row of every step once: the standby computed the lost worker's share"
    rows = [
        json.loads(ln) for ln in (Path(live.storage) / "runs" / live.name / "metrics.jsonl").read_text().splitlines()
    ]
    took_part = [r["participants"] for r in rows if "participants" in r]
    assert len(took_part) == 40, took_part
    # (the first step may go before every worker has joined; from the kill on, the standby always took the share)
    assert min(took_part[12:]) == 2, f"never one worker for two shares: {took_part}"
    assert results[1]["resumed_from"] == "a live peer", "the replacement healed from a peer and stood by"


@pytest.mark.parametrize(
    ("rank", "leader", "writing", "participants", "leads", "opens"),
    [
        (1, 1, False, [0, 1], 1, True),  # a replacement inherits the lead of the process it replaces: opens the log
        (0, 1, False, [0], 0, True),  # the leader lost: the lowest live replica takes over
        (0, 0, True, [0, 1], 0, False),  # the leader, already writing
        (1, 0, False, [0, 1], 0, False),  # a replica that does not lead writes nothing
        (0, None, False, [0, 1], 0, True),  # the first step: the lowest replica leads
    ],
)
def test_who_leads_after_a_step_and_whether_it_opens_the_log(
    rank, leader, writing, participants, leads, opens, monkeypatch
) -> None:
    from ray_jobs.checkpoint import LoopState
    from ray_jobs.train import live_trainer
    from ray_jobs.train.trainer import Trainer

    class Log:
        def __init__(self):
            self.rows = []

        def append(self, row):
            self.rows.append(row)

    opened = []

    def open_log(self, resumed):
        opened.append(resumed)
        self.metrics = Log()

    monkeypatch.setattr(Trainer, "open_log", open_log)
    t = object.__new__(live_trainer.LiveTrainer)
    t.ray_rank, t.workers, t.leader, t.participants, t.heals, t.healed = rank, 2, leader, [0, 1], [], None
    t.metrics = Log() if writing else None
    t.history, t.history_base = [{"step": 5, "loss": 1.0}, {"step": 10, "loss": 0.9}], 0
    t.loop, t.last_step_at = LoopState(step=12), 0.0
    t._took_part(participants, [0.0] * (live_trainer.HEAD + 2 * t.workers))
    assert t.leader == leads
    assert bool(opened) == opens and (not opens or [r["step"] for r in t.metrics.rows] == [5, 10]), opened
    assert t.leads() == (rank == leads)


@pytest.mark.parametrize(
    ("tries", "heal_failed", "gives_up_at"),
    [
        ([0, 5, 9.9], True, None),  # a heal failing for less than 10 x replica_timeout_s: try again
        ([0, 5, 10], True, 10),  # ... for that long: this replica leaves
        ([0, 30, 59], False, None),  # any other failure: 60 x replica_timeout_s
        ([100, 130, 160], False, 160),  # counted from the step's first failed try
    ],
)
def test_a_step_that_cannot_commit_is_given_up_after_a_bound(tries, heal_failed, gives_up_at) -> None:
    clock = iter(tries)
    retries = Retries(1, 1.0, clock=lambda: next(clock))
    for t in tries:
        if t == gives_up_at:
            with pytest.raises(StepStuck, match=r"replica 1: step 7 not committed for \d+s.*last cause: OSError: gone"):
                retries.failed(7, OSError("gone"), heal_failed)
        else:
            retries.failed(7, OSError("gone"), heal_failed)


def test_retention_counts_sealed_checkpoints_only_and_never_deletes_the_last_valid_one(tmp_path: Path) -> None:
    """A dead job left a folder at a higher step whose write never finished: the leader's retention keeps the
    newest ``num_to_keep`` sealed checkpoints whatever lies beside them (it once kept that folder's name and deleted
    the run's every valid checkpoint)."""
    from ray_jobs.checkpoint import format as ckpt
    from ray_jobs.train.live import Solo

    def sealed(step: int) -> str:
        url = str(tmp_path / ckpt.checkpoint_name(step))
        entries = ckpt.write_part(ckpt.Part(step, {ckpt.STATE_FILE: ("json", {"step": step})}), url)
        ckpt.write_manifest(url, step, 1, False, [entries])
        return url

    newest = [sealed(s) for s in (10, 20, 30)][-1]
    torn = tmp_path / ckpt.checkpoint_name(90)  # a dead job's: files, no manifest
    torn.mkdir()
    (torn / ckpt.STATE_FILE).write_text("{}")
    Solo("cpu", 1, str(tmp_path)).report({"step": 30}, newest)
    assert ckpt.find_latest_valid(str(tmp_path))[0] == newest, "the newest sealed checkpoint is kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.checkpoint_name(30), torn.name]
