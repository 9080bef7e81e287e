"""Elastic world size with exact data accounting (plain torch.distributed, gloo): a run that shrinks from 2 workers
to 1 and grows back trains every step on the same rows as an uninterrupted 2-worker run -- no row repeated, none
skipped -- under DDP and FSDP (resharded), with the global batch kept; what cannot be resumed says why."""

from __future__ import annotations

import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, ConfigError, WorkerRange, load_config
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import StepPlan
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.train.rowtrace import ENV, trained_rows
from tests.conftest import ROOT, tiny_overrides
from tests.unit.dist_runs import run_world, train_rank


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("elastic") / "storage"
    overrides = {"train.lr": 0.01, "train.warmup_steps": 3, "cluster.num_workers": 2, "cluster.cpus_per_worker": 1,
                 "train.max_steps": 30, "checkpoint.every_steps": 10, "model.tiny.num_layers": 2,
                 "data.min_shards": 6}  # fmt: skip
    cfg = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(storage, **overrides))
    model = str(storage.parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    return cfg, stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


def elastic(cfg: Config, name: str, parallelism: str) -> Config:
    c = cfg.model_copy(deep=True)
    c.name, c.train.parallelism = name, parallelism
    c.cluster.num_workers = WorkerRange(min=1, max=2)
    return c


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_shrinking_and_growing_trains_every_row_of_the_uninterrupted_run_once(
    setup, parallelism, tmp_path, monkeypatch
) -> None:
    cfg, manifest, model = setup
    monkeypatch.setenv(ENV, str(tmp_path / "straight"))
    straight = run_world(train_rank, 2, elastic(cfg, f"straight-{parallelism}", parallelism), manifest, model, None)
    c = elastic(cfg, f"elastic-{parallelism}", parallelism)
    monkeypatch.setenv(ENV, str(tmp_path / "elastic"))
    run_world(train_rank, 2, c, manifest, model, 15)  # checkpoint at 10; steps 11-15 are lost with the node
    shrunk = run_world(train_rank, 1, c, manifest, model, 25)  # one worker left: resumes at 10, checkpoints at 20
    assert shrunk[0]["resumed_from"].endswith(ckpt.checkpoint_name(10))
    grown = run_world(train_rank, 2, c, manifest, model, None)  # the node is back
    assert grown[0]["resumed_from"].endswith(ckpt.checkpoint_name(20)) and grown[0]["step"] == 30

    want, _ = trained_rows(tmp_path / "straight")
    got, worlds = trained_rows(tmp_path / "elastic")
    assert sum(want.values()) == 30 * 2 * cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    assert got == want, "every (epoch, row) of the uninterrupted run, each as often"
    assert worlds == [(2, 1, 10), (1, 11, 20), (2, 21, 30)], "world sizes over time (steps that counted)"
    # Same rows, same global batch, same optimizer and schedule: the same training up to float summation order.
    assert grown[0]["eval_loss"] == pytest.approx(straight[0]["eval_loss"], rel=1e-4)


def test_a_step_trains_the_same_rows_at_every_world_size_even_when_a_data_rank_is_split(setup) -> None:
    """3 data ranks x 2 micro-batches per step over 2 workers: each runs 3, one data rank's two split between them."""
    cfg, manifest, _ = setup
    cache = ShardCache(cfg.storage, manifest.dataset_id, cfg.data.cache_dir, 1e12)

    def rows(world: int) -> list[set]:
        plans = [StepPlan(cache, manifest.shards["train"], manifest.seq_len, data_ranks=3, grad_accum_steps=2,
                          micro_batch_size=4, seed=0, rank=r, world_size=world) for r in range(world)]  # fmt: skip
        cursors, out = plans[0].start(), []
        for _ in range(40):  # past an epoch of the smallest data rank
            step = set()
            for p in plans:
                for k in range(p.micro_batches):
                    v, idx, epochs = p.batch(cursors, k)
                    step |= {(int(e), f, r) for e, (f, r) in zip(epochs, p.identify(v, idx), strict=True)}
            out.append(step)
            cursors = plans[0].after(cursors)
        return out

    three, two, one = rows(3), rows(2), rows(1)
    assert three == two == one
    assert all(len(s) == 3 * 2 * 4 for s in three)
    assert len({e for s in three for e, _, _ in s}) > 1, "the steps cross into the next epoch"


def test_an_elastic_size_that_cannot_keep_the_global_batch_or_is_upside_down_is_refused() -> None:
    base = ["storage=/tmp/x"]
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "demo.yaml", [*base, "cluster.num_workers={min: 3, max: 2}"])
    assert "cluster.num_workers: min (3) is above max (2)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "demo.yaml", [*base, "cluster.num_workers={min: 2, max: 4}"])
    text = str(err.value)
    assert "cluster.num_workers:" in text and "3 worker(s) cannot share evenly" in text
    assert "train.grad_accum_steps to a multiple of 3" in text
    ok = load_config(ROOT / "configs" / "demo.yaml",
                     [*base, "cluster.num_workers={min: 2, max: 4}", "train.grad_accum_steps=3"])  # fmt: skip
    assert ok.cluster.elastic and (ok.cluster.min_workers, ok.cluster.max_workers) == (2, 4)


def test_a_checkpoint_laid_out_for_other_data_ranks_is_refused_naming_the_setting(setup) -> None:
    cfg, manifest, model = setup
    c = elastic(cfg, "layout", "ddp")
    run_world(train_rank, 2, c, manifest, model, 10)
    c.cluster.num_workers = 3
    with pytest.raises(Exception, match=r"laid out for 2 workers, this run's for 3.*num_workers.*= 2"):
        run_world(train_rank, 1, c, manifest, model, None)
