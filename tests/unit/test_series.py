"""Retraining as a lineage, without a cluster: run name templates, the series registry, the promotion gate, warm
starts and retention, on a real storage folder with run registries as the flow writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from control import registry, series
from control.records.run import RunRecord
from control.records.series import EvalPin
from control.series import promotion
from ray_jobs.config import ConfigError, load_config
from ray_jobs.storage import Layout
from tests.conftest import ROOT, tiny_overrides
from tests.unit.test_trainer import setup  # noqa: F401 (a fixture: a staged tiny dataset and model)

DEMO = ROOT / "configs" / "demo.yaml"


def cfg(storage: Path, **extra):
    return load_config(DEMO, tiny_overrides(storage, **extra))


# -- run name templates ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "series_name"),
    [("demo", "demo"), ("nightly-{dataset}", "nightly"), ("{date}-chat-{dataset}", "chat"),
     ("a-{date}-b-{time}", "a-b")],
)  # fmt: skip
def test_a_template_names_its_series_by_what_is_left_without_placeholders(tmp_path, name, series_name) -> None:
    c = cfg(tmp_path, name=name)
    assert c.series_name == series_name and c.is_template == ("{" in name)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"name": "x-{foo}"}, "name: unknown placeholder {foo} (known: {dataset}, {date}, {time})"),
        ({"name": "Nightly-{date}"}, "name: 'Nightly-{date}' (renders like 'Nightly-20261123') must be 1-63"),
        ({"name": "x-{dataset}-" + "y" * 60}, "name: 'x-{dataset}-yyy"),
        ({"name": "{date}-{dataset}"}, "series.name: name '{date}-{dataset}' is only placeholders"),
        ({"series.name": "Bad Name"}, "series.name: 'Bad Name' must be 1-63"),
        ({"model.init_from": "champion"}, "model.init_from: Input should be 'base', 'series-champion' or"),
        ({"series.min_improvement": 1.5}, "series.min_improvement:"),
    ],
)
def test_bad_templates_and_series_settings_are_config_errors_naming_the_field(tmp_path, extra, says) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(tmp_path, **extra)
    assert says in str(e.value), str(e.value)


def test_a_template_resolves_once_to_a_valid_run_name_that_keeps_its_series(tmp_path) -> None:
    c = cfg(tmp_path, name="{date}-chat-{dataset}-{time}")
    at = 1795400000.0  # 2026-11-23 02:13:20 UTC
    r = c.resolved("ds-49a92c170ebaf51f", at)
    assert r.name == "20261123-chat-49a92c17-021320" and not r.is_template
    assert r.series_name == "chat" and r.series.name == "chat", "the recorded config still knows its series"
    assert c.resolved("ds-49a92c170ebaf51f", at).name == r.name, "the same inputs, the same name"


def test_an_only_placeholder_template_is_fine_once_the_series_is_named(tmp_path) -> None:
    assert cfg(tmp_path, name="{dataset}", **{"series.name": "sums"}).series_name == "sums"


# -- the promotion gate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("score", "champion", "min_improvement", "promoted"),
    [(1.0, None, 0.0, True), (0.9, 1.0, 0.0, True), (1.0, 1.0, 0.0, False), (1.1, 1.0, 0.0, False),
     (0.95, 1.0, 0.1, False), (0.89, 1.0, 0.1, True)],
)  # fmt: skip
def test_a_challenger_must_beat_the_champion_by_the_margin(score, champion, min_improvement, promoted) -> None:
    ok, why = series.decide(score, champion, min_improvement)
    assert ok == promoted and f"{score:.4f}" in why


# -- the lineage on storage --------------------------------------------------------------------------------------
PIN = EvalPin(dataset_id="ds-eval", manifest_url="m", source="first")


def _finished_run(c, dataset_id: str, score: float | None, steps=(10, 20, 30), parent=None, state="succeeded"):
    """What a run leaves on storage when it ends: registry, checkpoints, final folder, score (as the job writes).
    ``parent``: the run it was warm-started from."""
    lay = Layout(c.storage)
    series.begin_run(c, dataset_id, PIN, parent, None)
    reg = RunRecord(state=state, config=json.loads(c.model_dump_json()), dataset_id=dataset_id, attempts=[])
    registry.save(c.storage, c.name, reg)
    for s in steps:
        d = Path(lay.checkpoints_dir(c.name)) / f"checkpoint-step-{s:08d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
    final = Path(lay.final_model(c.name))
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps({"run": c.name}))
    (final / "model.safetensors").write_bytes(c.name.encode() * 100)
    (final / "README.md").write_text(f"# {c.name}")
    if score is not None:
        Path(lay.score(c.name)).write_text(json.dumps({"eval_loss": score, "dataset_id": "ds-eval"}))


@pytest.mark.parametrize(("files", "published"), [
    ({"config.json", "model.safetensors", "README.md"}, True),
    ({"adapter_config.json", "adapter_model.safetensors", "README.md"}, True),  # train.export: adapter
    ({"config.json", "model.safetensors"}, False),  # README.md, written last, missing: the upload did not finish
    ({"adapter_model.safetensors", "README.md"}, False),
])  # fmt: skip
def test_a_final_folder_is_published_as_champion_only_whole(tmp_path, monkeypatch, files, published) -> None:
    monkeypatch.setattr(promotion, "_emit", lambda v: None)
    c = _run(tmp_path, "sums-a")
    _finished_run(c, "ds-a", 1.0)
    final = Path(Layout(c.storage).final_model(c.name))
    for f in final.iterdir():
        f.unlink()
    for name in files:
        (final / name).write_text(name)
    if published:
        assert series.finish_run(c.storage, c.name).promoted
        assert set(series.champion(str(tmp_path), "sums").files) == files
    else:
        with pytest.raises(FileNotFoundError, match="final folder .* is incomplete; not publishing it"):
            series.finish_run(c.storage, c.name)


def _run(storage: Path, name: str, **extra):
    return cfg(storage, name=name, **{"series.name": "sums"} | extra)


def test_the_better_run_is_champion_and_a_worse_one_leaves_the_champion_byte_identical(tmp_path, monkeypatch) -> None:
    events = []
    monkeypatch.setattr(promotion, "_emit", events.append)
    first, second, third = (_run(tmp_path, n) for n in ("sums-a", "sums-b", "sums-c"))
    _finished_run(first, "ds-a", 1.0)
    assert series.finish_run(first.storage, "sums-a").promoted
    _finished_run(second, "ds-b", 0.8, parent="sums-a")
    verdict = series.finish_run(second.storage, "sums-b")
    assert verdict.promoted and verdict.champion == "sums-a" and verdict.champion_score == 1.0
    pointer_path = Path(Layout(str(tmp_path)).champion("sums"))
    before = pointer_path.read_bytes()
    pointer = json.loads(before)
    assert pointer["run"] == "sums-b" and pointer["folder"].endswith("runs/sums-b/final")
    assert set(pointer["files"]) == {"config.json", "model.safetensors", "README.md"}
    assert series.champion(str(tmp_path), "sums").files == pointer["files"]

    _finished_run(third, "ds-c", 0.95)
    rejected = series.finish_run(third.storage, "sums-c")
    assert not rejected.promoted and "does not beat the champion's 0.8000" in rejected.why
    assert pointer_path.read_bytes() == before, "a rejected challenger never touches the champion pointer"
    assert [e.promoted for e in events] == [True, True, False]
    assert series.finish_run(third.storage, "sums-c") == rejected and len(events) == 3, "decided once"

    rows = series.table(str(tmp_path), "sums")
    assert [(r["run"], r["champion"], r["parent"]) for r in rows] == [
        ("sums-a", False, None), ("sums-b", True, "sums-a"), ("sums-c", False, None)]  # fmt: skip
    text = series.format_table(rows)
    assert "sums-b" in text and "0.8000" in text
    assert any("promotion: not promoted" in line for line in series.lineage_lines(str(tmp_path), "sums-c"))


def test_after_success_only_keep_after_success_checkpoints_remain(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(promotion, "_emit", lambda v: None)
    c = _run(tmp_path, "sums-a", **{"checkpoint.keep_after_success": 1})
    _finished_run(c, "ds-a", 1.0)
    active = _run(tmp_path, "sums-b")
    _finished_run(active, "ds-b", None, state="running")
    series.finish_run(c.storage, "sums-a")
    left = lambda run: [s for s, _ in registry_ckpts(tmp_path, run)]  # noqa: E731
    assert left("sums-a") == [30]
    assert left("sums-b") == [30, 20, 10], "an active run's checkpoints are untouched"
    assert series.trim_checkpoints(str(tmp_path), "sums-b", 1) == [], "never while it is active"


def registry_ckpts(storage: Path, run: str):
    from ray_jobs import checkpoint as ckpt

    return ckpt.list_checkpoints(Layout(str(storage)).checkpoints_dir(run))


def test_keep_runs_deletes_old_finals_but_never_the_champion_or_an_active_runs_parent(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(promotion, "_emit", lambda v: None)
    a, b, c, d = (_run(tmp_path, f"sums-{x}", **{"series.keep_runs": 1}) for x in "abcd")
    _finished_run(a, "ds-a", 0.5)  # the champion: never beaten below
    series.finish_run(a.storage, "sums-a")
    _finished_run(b, "ds-b", 0.9)
    series.finish_run(b.storage, "sums-b")
    _finished_run(d, "ds-d", None, parent="sums-b", state="running")  # trains from b's final
    _finished_run(c, "ds-c", 0.8)
    series.finish_run(c.storage, "sums-c")
    finals = {r: Path(Layout(str(tmp_path)).final_model(r)).exists() for r in ("sums-a", "sums-b", "sums-c")}
    assert finals == {"sums-a": True, "sums-b": True, "sums-c": True}, "b is d's parent; c is the newest kept"
    registry.update(str(tmp_path), "sums-d", state="failed")
    e = _run(tmp_path, "sums-e", **{"series.keep_runs": 1})
    _finished_run(e, "ds-e", 0.7)
    series.finish_run(e.storage, "sums-e")
    finals = {r: Path(Layout(str(tmp_path)).final_model(r)).exists() for r in ("sums-a", "sums-b", "sums-c", "sums-e")}
    assert finals == {"sums-a": True, "sums-b": False, "sums-c": False, "sums-e": True}


def test_warm_start_from_the_champion_or_the_latest_and_none_before_there_is_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(promotion, "_emit", lambda v: None)
    champ = _run(tmp_path, "sums-c", **{"model.init_from": "series-champion"})
    assert series.warm_start(champ) is None, "no champion yet: the caller falls back to the base model"
    a, b = _run(tmp_path, "sums-a"), _run(tmp_path, "sums-b")
    _finished_run(a, "ds-a", 0.5)
    series.finish_run(a.storage, "sums-a")
    _finished_run(b, "ds-b", 0.9)
    series.finish_run(b.storage, "sums-b")
    assert series.warm_start(champ).run == "sums-a"
    latest = _run(tmp_path, "sums-c", **{"model.init_from": "series-latest"})
    final = Layout(str(tmp_path)).final_model("sums-b")
    assert series.warm_start(latest) == series.WarmStart("sums-b", final, "series-latest")
    assert series.warm_start(_run(tmp_path, "sums-c")) is None, "init_from=base"


def test_the_same_dataset_and_recipe_is_trained_once_per_series(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(promotion, "_emit", lambda v: None)
    a = _run(tmp_path, "sums-a")
    _finished_run(a, "ds-a", 1.0)
    series.finish_run(a.storage, "sums-a")
    again = _run(tmp_path, "sums-a2")
    assert series.already_trained(again, "ds-a").run == "sums-a", "another run name, the same data: trained"
    assert series.already_trained(again, "ds-b") is None, "new data"
    longer = _run(tmp_path, "sums-a2", **{"train.max_steps": 60})
    assert series.already_trained(longer, "ds-a") is None, "another recipe trains again"
    other = cfg(tmp_path, name="other-a")
    assert series.already_trained(other, "ds-a") is None, "another series"


def test_a_recipe_hashes_as_it_did_when_runs_were_recorded_so_an_upgrade_retrains_nothing() -> None:
    """The demo recipe's hash, as series records written by earlier releases hold it: a new train field at its
    default (``compile``, ``export``) must not change it, or every series would train its data again."""
    demo = load_config(ROOT / "configs" / "demo.yaml", [])
    assert series.recipe(demo) == "0dee3b616468c31d"
    assert series.recipe(demo.model_copy(update={"train": demo.train.model_copy(update={"export": "adapter"})})) != (
        "0dee3b616468c31d"
    ), "a field set away from its default is another recipe"


def test_a_missing_series_eval_source_is_a_config_error_naming_the_field(tmp_path) -> None:
    c = _run(tmp_path, "sums-a", **{"series.eval": str(tmp_path / "nope.jsonl")})
    with pytest.raises(ConfigError, match="series.eval: no such file or folder"):
        series.check_eval_source(c)


# -- the series' fixed eval set ----------------------------------------------------------------------------------
def test_a_series_eval_set_is_staged_on_its_own_and_pinned_by_its_dataset_id(setup, tmp_path) -> None:  # noqa: F811
    from ray_jobs.storage import read_json
    from tasks.lineage import _eval_pin
    from tasks.stage import Staged
    from tests.conftest import SAMPLE_DATA

    base, manifest, model = setup
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(SAMPLE_DATA.read_text().splitlines(keepends=True)[:200]))
    c = base.model_copy(deep=True)
    c.series.eval = str(held_out)
    staged = Staged(manifest.dataset_id, "unused", True, {"eval_rows": 3})
    pin = _eval_pin(c, staged, model)
    assert pin.source == str(held_out) and pin.dataset_id != manifest.dataset_id
    fixed = read_json(pin.manifest_url)
    assert [f["url"] for f in fixed["sources"]["eval"]] == [str(held_out)] and fixed["counts"]["eval_rows"] > 0
    assert _eval_pin(c, staged, model) == pin, "staged once: the same data is the same pinned id"

    no_eval = Staged(manifest.dataset_id, "m", True, {"eval_rows": 0})
    with pytest.raises(ConfigError, match="series.eval: the eval split of run t has no eval rows"):
        _eval_pin(base, no_eval, model)
