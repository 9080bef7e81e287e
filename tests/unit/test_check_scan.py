"""``unbroken check`` reads every record as staging does (control/check/scan.py): what staging would refuse is exit
2 naming ``file:line``, and what it counts -- records, rejects and their reasons, tokens, rows, shards -- is what
staging counts when it stages the same data here, in-process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from control.check import scan, schedule
from ray_jobs.config import Config, load_config
from ray_jobs.config.epochs import resolve_epochs
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import train_char_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA
from unbroken.cli import main

DEMO = str(ROOT / "configs" / "demo.yaml")
PORTS = ["cluster.dashboard_port=8597", "cluster.head_port=6597"]  # nothing answers there: no cluster work


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer()


def pair(i: int) -> str:
    return json.dumps({"input": f"{i}+{i}=", "target": str(2 * i)})


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def config(tmp_path: Path, **sets: object) -> Config:
    base = {"storage": tmp_path / "storage", "data.work_dir": tmp_path / "work"}
    return load_config(DEMO, [f"{k}={v}" for k, v in {**base, **sets}.items()] + PORTS)


def check(tmp_path: Path, capfd, **sets: object) -> tuple[int, str]:
    sets = {"storage": tmp_path / "storage", **sets}
    code = main(["check", DEMO, *[a for s in [f"{k}={v}" for k, v in sets.items()] + PORTS for a in ("--set", s)]])
    out, err = capfd.readouterr()
    return code, out + err


def data_block(out: str) -> list[str]:
    """The lines of the report's data problem: its first line and those indented under it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PROBLEM data"))
    return [lines[start], *[line for line in lines[start + 1 :] if line.startswith(" ")][:5]]


def test_a_bad_500th_line_is_exit_2_naming_file_500(tmp_path: Path, capfd) -> None:
    bad = write(tmp_path / "bad.jsonl", [pair(i) if i != 500 else '{"input": "broken' for i in range(1, 1001)])
    code, out = check(tmp_path, capfd, **{"data.train": bad})
    assert code == 2, out
    block = data_block(out)
    assert "1 of 1000 records rejected (0.1%), over data.max_reject_fraction=0.0" in block[0], out
    assert f"{bad}:500: invalid JSON" in block[1] and len(block) <= 3, out
    assert "1 problem(s): this run would not start" in out, out


def test_an_empty_eval_split_is_exit_2(tmp_path: Path, capfd) -> None:
    few = write(tmp_path / "few.jsonl", [pair(i) for i in range(20)])
    code, out = check(tmp_path, capfd, **{"data.train": few, "data.eval_fraction": 0.0})
    assert code == 2, out
    assert "PROBLEM data     the eval split is empty: raise data.eval_fraction or set data.eval" in out, out


@pytest.mark.parametrize(
    ("name", "says"),
    [("missing.jsonl", "data.train: no such file or folder: {path}"), ("empty.jsonl", "no records found in {path}")],
)
def test_what_staging_refuses_before_counting_is_exit_2_naming_the_file(name, says, tmp_path: Path, capfd) -> None:
    path = tmp_path / name
    if name == "empty.jsonl":
        path.write_text("\n\n")
    code, out = check(tmp_path, capfd, **{"data.train": path})
    assert code == 2 and f"PROBLEM data     {says.format(path=path)}" in out, out


def test_many_rejects_name_two_and_count_the_rest_in_three_lines(tmp_path: Path, capfd) -> None:
    lines = [pair(i) for i in range(100)]
    lines[9], lines[19], lines[29] = '{"input": "1+1="}', "[1, 2]", "not json"
    code, out = check(tmp_path, capfd, **{"data.train": write(tmp_path / "bad.jsonl", lines)})
    block = data_block(out)
    assert code == 2 and len(block) == 3, out
    assert block[1].endswith("bad.jsonl:10: missing field 'target'"), out
    assert ":20: expected a JSON object, got list" in block[2] and "... and 1 more" in block[2], out


def mixed_pairs(tmp_path: Path) -> Path:
    """The sample data with bad lines, a blank one and records over data.seq_len (64 tokens of the demo)."""
    lines = SAMPLE_DATA.read_text().splitlines()[:600]
    lines[10], lines[50], lines[51] = '{"input": "broken', "", json.dumps({"input": "x" * 30, "target": "y" * 40})
    lines[300] = json.dumps({"input": "7+7=", "target": ""})
    lines.append(json.dumps({"input": "é" * 3, "target": "ü"}))  # characters the tokenizer cannot represent
    return write(tmp_path / "mixed.jsonl", lines)


def long_documents(tmp_path: Path) -> Path:
    """``text`` records: short ones, one document longer than a tokenizing window (read back in pieces), a bad one."""
    docs = [{"text": f"document {i} " * (1 + i % 9)} for i in range(300)]
    docs[7] = {"text": "a long one " * 30_000}  # 330,000 characters: over documents.WINDOW_CHARS
    docs[8] = {"txt": "no text field"}
    return write(tmp_path / "docs.jsonl", [json.dumps(d) for d in docs])


CASES = {
    "pairs": (mixed_pairs, {"data.max_reject_fraction": 0.5}),
    "pairs, too long dropped": (mixed_pairs, {"data.max_reject_fraction": 0.5, "data.too_long": "drop"}),
    "pairs, too long truncated": (mixed_pairs, {"data.max_reject_fraction": 0.5, "data.too_long": "truncate"}),
    "text": (long_documents, {"data.format": "text", "data.max_reject_fraction": 0.5}),
    "preference": (
        lambda _: ROOT / "configs" / "data" / "preferences.jsonl",
        {"data.format": "preference", "train.engine": "hf"},
    ),
}


def mixture(tmp_path: Path) -> str:
    """Two sources weighted 3:1, the lighter with a bad record: its rows subsampled, its reject named by its file."""
    a = write(tmp_path / "a.jsonl", [pair(i) for i in range(300)])
    b = write(tmp_path / "b.jsonl", [pair(i) if i != 7 else '{"input": "x"}' for i in range(300, 700)])
    return f"[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]"


CASES["mixture"] = (mixture, {"data.max_reject_fraction": 0.01})


@pytest.mark.parametrize("case", CASES)
def test_the_scan_counts_what_staging_counts(case: str, tmp_path: Path, tokenizer) -> None:
    make, sets = CASES[case]
    cfg = config(tmp_path, **{"data.train": make(tmp_path), **sets})
    found = scan.scan(cfg, tokenizer, "builtin")
    staged = stage(cfg.data, tokenizer, "builtin", str(tmp_path / "staged"))
    counts = staged.manifest.counts.model_dump()
    for name in ("records", "rejects", "dropped", "truncated", "train_examples", "eval_examples", "train_tokens"):
        assert found.counts[name] == counts[name], (name, found.counts, counts)
    assert found.rows == {"train": counts["train_rows"], "eval": counts["eval_rows"]}
    predicted = schedule.manifest(found)
    for split in ("train", "eval"):
        assert [s.rows for s in predicted.shards[split]] == [s.rows for s in staged.manifest.shards[split]], split
    rejects = tmp_path / "staged" / "datasets" / staged.dataset_id / "rejects.jsonl"
    assert [r.to_json() for r in found.rejects()] == [json.loads(x) for x in rejects.read_text().splitlines()]
    assert sum(s.tokens for s in found.sources) >= counts["train_tokens"]


def test_steps_and_epochs_are_told_both_ways(tmp_path: Path, tokenizer) -> None:
    """The demo's data on its 2 data ranks (4 train shards: data rank v owns shards v and v+2), 16 rows a step."""
    cfg = config(tmp_path, **{"data.train": SAMPLE_DATA})
    predicted = schedule.manifest(scan.scan(cfg, tokenizer, "builtin"))
    staged = stage(cfg.data, tokenizer, "builtin", str(tmp_path / "staged")).manifest
    most = max(sum(s.rows for s in staged.shards["train"][v::2]) for v in range(2))
    layout = "(2 data ranks over 4 train shards, 16 rows a step each)"

    by_epochs = cfg.model_copy(update={"train": cfg.train.model_copy(update={"epochs": 3})})
    lines, run = schedule.findings(by_epochs, predicted)
    steps = resolve_epochs(by_epochs, staged).train.max_steps  # what the flow will run, once staged
    assert run.train.max_steps == steps == math.ceil(3 * most / 16)
    assert lines[0].text == (
        f"train.epochs=3 is {steps:,} steps: 3 passes over the {most:,} rows of the data rank with the most {layout}"
    )

    lines, run = schedule.findings(cfg, predicted)
    assert run.train.max_steps == 2500
    assert lines[0].text == (
        f"train.max_steps=2,500 is {2500 * 16 / most:,.2f} epochs: 40,000 rows a data rank, of the {most:,} the one "
        f"with the most has {layout}"
    )


def test_a_time_estimate_only_from_a_measurement_that_applies(tmp_path: Path, monkeypatch) -> None:
    import bench.results

    cfg = config(tmp_path)
    here = bench.results.machine()
    entry = {"measured": "2026-11-27", "machine": here, "native_tokens_per_s": 1000.0, "hf_tokens_per_s": 800.0}
    monkeypatch.setattr(bench.results, "load", lambda: {"engine_throughput": entry})
    assert schedule.measured(cfg) == (1000.0, f"bench/results.json engine_throughput, 2026-11-27, {here}, one worker")
    other = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": 32})})
    assert schedule.measured(other) is None  # not the work measured
    monkeypatch.setattr(bench.results, "load", lambda: {"engine_throughput": {**entry, "machine": "64 cores, arm64"}})
    assert schedule.measured(cfg) is None  # not this machine


@pytest.mark.parametrize("command", ["stage", "run"])
def test_a_data_error_in_stage_or_run_is_at_most_3_lines_in_all_before_prefect(command, tmp_path: Path) -> None:
    """Small local sources are read in full before Prefect starts (control/check refuse_early): a bad record is the
    command's only output, on a user's quiet terminal."""
    import os
    import subprocess
    import sys

    bad = write(tmp_path / "bad.jsonl", [pair(i) if i != 500 else '{"input": "broken' for i in range(1, 1001)])
    sets = [f"storage={tmp_path / 'storage'}", f"data.train={bad}", *PORTS]
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_VERBOSE"}
    argv = [sys.executable, "-m", "unbroken", command, DEMO, *[a for s in sets for a in ("--set", s)]]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and 1 <= len(lines) <= 3, lines
    assert lines[0].startswith("error: ") and any(f"{bad}:500: invalid JSON" in line for line in lines), lines
    assert not (tmp_path / "storage" / "datasets").exists(), "refused before staging"
