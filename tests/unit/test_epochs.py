"""``train.epochs``: steps from the staged dataset, every row trained exactly that many times (the row trace), and a
run killed mid-epoch resumed bit-identical to an uninterrupted one -- on 2 ranks of plain torch.distributed whose
data ranks hold unequal rows, so one finishes its passes a little before the other. The data is a mixture of two
sources weighted 3:1 (``data.train`` a list), so the same run proves the mixture: its trained rows come from the
sources in that proportion, through the kill and the resume."""

from __future__ import annotations

from collections import Counter

import pytest

from control.config import load_config as load_checked
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, ConfigError, load_config
from ray_jobs.config.epochs import data_rank_rows, epoch_steps, resolve_epochs, steps_problems
from ray_jobs.contracts.dataset import Shard
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.train.rowtrace import ENV, trained_rows
from tests.conftest import ROOT, tiny_overrides
from tests.unit.dist_runs import run_world, train_rank


def shards(*rows: int) -> list[Shard]:
    return [Shard(file=f"s{i}.parquet", rows=r, bytes=1, sha256="x") for i, r in enumerate(rows)]


@pytest.mark.parametrize(
    ("rows", "data_ranks", "per_step", "epochs", "per_rank", "steps"),
    [
        ((10, 10, 10, 10), 2, 4, 1, [20, 20], 5),
        ((10, 10, 10, 10), 2, 4, 2, [20, 20], 10),
        ((10, 10, 7), 2, 4, 2, [17, 10], 9),  # the data rank with the most rows sets the steps
        ((10, 10, 7), 2, 3, 1, [17, 10], 6),  # a last step only partly of the final pass
        ((5,), 1, 64, 3, [5], 1),
    ],
)
def test_steps_follow_from_the_data_rank_with_the_most_rows(rows, data_ranks, per_step, epochs, per_rank, steps):
    assert data_rank_rows(shards(*rows), data_ranks) == per_rank
    assert epoch_steps(shards(*rows), data_ranks, per_step, epochs) == steps


@pytest.mark.parametrize(
    ("train", "tune", "problem"),
    [
        ({"epochs": 2}, None, None),
        ({"max_steps": 10}, None, None),
        ({"epochs": None, "max_steps": 10}, None, None),
        ({"epochs": 2, "max_steps": 10}, None, "train.epochs (2) and train.max_steps (10): set one of the two"),
        ({"epochs": 2}, {"num_trials": 2}, "train.epochs: a search trains every trial to train.max_steps"),
        ({"evals_per_epoch": 2, "eval_every_steps": 5}, None, "train.evals_per_epoch and train.eval_every_steps"),
    ],
)
def test_epochs_or_max_steps_as_written(train, tune, problem) -> None:
    found = steps_problems({"train": train, "tune": tune})
    assert found[0].startswith(problem) if problem else found == [], found


def test_a_config_naming_both_is_refused_naming_the_fields(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"train\.epochs \(2\) and train\.max_steps \(30\)"):
        load_checked(ROOT / "configs" / "demo.yaml", tiny_overrides(tmp_path, **{"train.epochs": 2}))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, object, str]:
    root = tmp_path_factory.mktemp("epochs")
    lines = (ROOT / "configs" / "data" / "addition.jsonl").read_text().splitlines(True)
    (root / "a.jsonl").write_text("".join(lines[:950]))
    (root / "b.jsonl").write_text("".join(lines[950:1500]))  # weighted 1: cut to a third of a's rows
    mixture = f"[{{path: {root / 'a.jsonl'}, weight: 3}}, {{path: {root / 'b.jsonl'}, weight: 1}}]"
    overrides = {"cluster.num_workers": 2, "cluster.cpus_per_worker": 1, "data.train": mixture,
                 "data.min_shards": 3, "data.shard_mb": 0.001, "train.micro_batch_size": 8,
                 "checkpoint.every_steps": 8, "train.eval_every_steps": 100}  # fmt: skip
    cfg = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(root / "storage", **overrides))
    cfg.train.epochs = 2
    model = str(root / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    manifest = stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest
    return resolve_epochs(cfg, manifest), manifest, model


def test_evals_and_saves_per_epoch_become_steps_of_the_staged_dataset(setup) -> None:
    cfg, manifest, _ = setup
    per_epoch = epoch_steps(manifest.shards["train"], 2, 8, 1)
    c = cfg.model_copy(deep=True)
    c.train.evals_per_epoch, c.checkpoint.saves_per_epoch = 2, 1
    got = resolve_epochs(c, manifest)
    assert (got.train.eval_every_steps, got.checkpoint.every_steps) == (round(per_epoch / 2), per_epoch)
    assert got.train.max_steps == cfg.train.max_steps == epoch_steps(manifest.shards["train"], 2, 8, 2)


def named(cfg: Config, name: str) -> Config:
    c = cfg.model_copy(deep=True)
    c.name = name
    return c


def test_two_epochs_of_a_3_to_1_mixture_train_every_row_twice_in_proportion_and_resume_mid_epoch_bit_identical(
    setup, tmp_path, monkeypatch
) -> None:
    cfg, manifest, model = setup
    per_rank = data_rank_rows(manifest.shards["train"], 2)
    assert per_rank[0] != per_rank[1], "unequal data ranks: one finishes its passes first"
    assert cfg.train.max_steps == epoch_steps(manifest.shards["train"], 2, 8, 2)

    monkeypatch.setenv(ENV, str(tmp_path / "straight"))
    straight = run_world(train_rank, 2, named(cfg, "straight"), manifest, model, None)
    rows, _ = trained_rows(tmp_path / "straight")
    every = {(f, r) for e, f, r in rows}
    assert len(every) == sum(s.rows for s in manifest.shards["train"]), "every training row, none left out"
    assert Counter(rows.values()) == {1: 2 * len(every)}, "each (epoch, row) once"
    assert {e for e, _, _ in rows} == {0, 1}, "two passes, not a row of a third"
    by_source = Counter(manifest.source_of(f, r) for (_, f, r) in rows.elements())
    a, b = by_source["data.train[0]"], by_source["data.train[1]"]
    assert a + b == rows.total() and abs(a - 3 * b) <= 2 * 3, f"trained rows by source {by_source}: 3:1"

    killed_at = cfg.train.max_steps // 2 + 6  # mid-way through the second pass, steps past a checkpoint's: redone
    assert killed_at % 8 and killed_at * 8 > per_rank[1]
    resumed = named(cfg, "resumed")
    monkeypatch.setenv(ENV, str(tmp_path / "resumed"))
    run_world(train_rank, 2, resumed, manifest, model, killed_at)
    after = run_world(train_rank, 2, resumed, manifest, model, None)
    assert after[0]["resumed_from"].endswith(ckpt.checkpoint_name(killed_at // 8 * 8))
    assert trained_rows(tmp_path / "resumed")[0] == rows, "the same rows, each as often"
    assert after[0]["weights"] == straight[0]["weights"], "bit-identical to the uninterrupted run"
