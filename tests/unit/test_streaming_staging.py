"""Streaming staging: the same bytes as the in-memory path, any pool size, resumable after kill -9, cheap cache hits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ray_jobs.data.fingerprint as fingerprint
import ray_jobs.data.staging as staging
from ray_jobs.config import DataConfig
from ray_jobs.data.staging import stage
from ray_jobs.data.tokenize import learned_mask, learned_mask_array
from ray_jobs.model.builtin import train_char_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA
from tests.unit.staging_cases import outputs, run_cases

GOLDEN = json.loads((Path(__file__).parent / "staging_golden.json").read_text())


def test_streaming_staging_writes_what_the_in_memory_path_wrote(tmp_path: Path) -> None:
    assert run_cases(tmp_path, work_dir=str(tmp_path / "work")) == GOLDEN


def test_a_pool_of_workers_and_tiny_batches_change_nothing(tmp_path: Path, monkeypatch) -> None:
    """Batches of ~3 KB cut records across every kind of boundary (rows, shards, progress records)."""
    monkeypatch.setattr(staging, "BATCH_BYTES", 3000)
    monkeypatch.setattr(staging, "COMMIT_BATCHES", 1)
    only = {"pairs-mixed-separate-eval", "text-parquet"}
    got = run_cases(tmp_path, only, workers=2, work_dir=str(tmp_path / "work"))
    assert got == {k: GOLDEN[k] for k in only}
    assert not any(p.is_dir() for p in (tmp_path / "work").iterdir()), "a finished staging leaves no spill behind"


def test_numpy_learned_mask_is_the_reference_mask() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        starts = np.sort(rng.integers(0, 30, n))
        widths = rng.integers(0, 4, n) * (rng.random(n) > 0.2)  # some tokens have no characters (special tokens)
        offsets = [(int(s), int(s + w)) for s, w in zip(starts, widths, strict=True)]
        spans = [(int(a), int(a + rng.integers(1, 10))) for a in rng.integers(0, 30, int(rng.integers(0, 3)))]
        got = learned_mask_array(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans).tolist()
        assert got == learned_mask(offsets, spans), (offsets, spans)


KILLABLE = """
import json, sys, time
import ray_jobs.data.spill as spill
import ray_jobs.data.staging as staging
from ray_jobs.config import DataConfig
from ray_jobs.model.builtin import train_char_tokenizer
if __name__ == "__main__":
    staging.BATCH_BYTES, staging.COMMIT_BATCHES = 4000, 1
    slow = float(sys.argv[3])
    for name in ("commit", "_save"):  # every progress record takes a while, so a kill lands mid-staging
        real = getattr(spill.Spill, name)
        setattr(spill.Spill, name, lambda self, *a, _real=real: (time.sleep(slow), _real(self, *a))[1])
    init = spill.Spill.__init__
    def report(self, *a):  # where this staging starts: a resumed one says so
        init(self, *a)
        print("START", json.dumps(self.progress), flush=True)
    spill.Spill.__init__ = report
    import ray_jobs.data.documents as documents
    documents.WINDOW_CHARS, documents.BACKOFF_CHARS, documents.CHECK_CHARS = 5000, 500, 200  # long: many windows
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    data = DataConfig(train=sys.argv[1], seq_len=64, shard_mb=0.01, min_shards=2, work_dir=sys.argv[2] + "/work",
                      **extra)
    staging.stage(data, train_char_tokenizer(), "builtin", sys.argv[2])
"""


def _staged(storage: Path) -> dict[str, str]:
    (ds,) = [p for p in (storage / "datasets").iterdir() if p.name.startswith("ds-")]
    return outputs(ds, [])


def _kill_when(storage: Path, ready, slow: float, src: Path = SAMPLE_DATA, extra: str = "{}") -> dict:
    """Start a staging into ``storage``, kill -9 it once ``ready(progress)`` holds, then stage to the end again;
    the progress the second staging started from."""
    cmd = [sys.executable, "-c", KILLABLE, str(src), str(storage), str(slow), extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 120
    progress_files = lambda: list((storage / "work").glob("*/progress.json"))  # noqa: E731
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if progress_files() and ready(json.loads(progress_files()[0].read_text())):
                break
        except ValueError:
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "staging ended before the kill"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert progress_files(), "the killed staging left its progress"
    assert not list(storage.glob("datasets/ds-*/manifest.json")), "and no manifest: the dataset is not staged"
    out = subprocess.run([*cmd[:-2], "0", extra], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.split("START ", 1)[1].splitlines()[0])


@pytest.mark.parametrize(
    "phase",
    [
        pytest.param(lambda p: p["phase"] == "read" and p["position"]["offset"] > 60_000, id="while-reading"),
        pytest.param(lambda p: len(p["shards"].get("train", [])) >= 3, id="while-writing-shards"),
    ],
)
def test_staging_killed_mid_way_resumes_and_ends_identical(tmp_path: Path, phase) -> None:
    whole = tmp_path / "whole"
    subprocess.run(
        [sys.executable, "-c", KILLABLE, str(SAMPLE_DATA), str(whole), "0"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    killed = tmp_path / "killed"
    resumed_from = _kill_when(killed, phase, slow=0.05)
    assert phase(resumed_from), "the second staging went on from where the first was killed"
    assert _staged(killed) == _staged(whole)


KILLED_BEFORE_RENAME = """
import os, signal, sys
import ray_jobs.storage as storage
from ray_jobs.config import DataConfig
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import train_char_tokenizer
real = os.replace
def replace(src, dst, _real=real):  # the third shard's file is created, then the process dies before its rename
    if ".parquet.tmp-" in str(src) and str(dst).endswith(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(src, dst)
storage.os.replace = replace
data = DataConfig(train=sys.argv[1], seq_len=64, shard_mb=0.01, min_shards=2, work_dir=sys.argv[2] + "/work")
stage(data, train_char_tokenizer(), "builtin", sys.argv[2])
"""


def test_a_staging_killed_between_a_shards_create_and_its_rename_leaves_no_orphan(tmp_path: Path) -> None:
    """kill -9 lands after a shard's temporary file was written and before it was renamed into place: the resumed
    staging removes that file, and the dataset's folder is byte for byte an uninterrupted staging's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cmd = [sys.executable, "-c", KILLED_BEFORE_RENAME, str(SAMPLE_DATA)]
    subprocess.run([*cmd, str(whole), "never"], env=env, check=True)
    died = subprocess.run([*cmd, str(killed), "train-00002.parquet"], env=env)
    assert died.returncode == -signal.SIGKILL
    (ds,) = killed.glob("datasets/ds-*")
    assert [p.name for p in ds.glob("*.tmp-*")] and not (ds / "manifest.json").exists(), sorted(ds.iterdir())
    subprocess.run([*cmd, str(killed), "never"], env=env, check=True)
    assert not list(ds.glob("*.tmp-*"))
    assert _staged(killed) == _staged(whole)


def test_staging_of_long_documents_killed_mid_document_resumes_and_ends_identical(tmp_path: Path) -> None:
    """Documents of 20-40k characters, encoded in 5k windows, pieces spilled beside the staging: a kill leaves
    some of a document's pieces on disk, and the resumed staging reads that document again from its start."""
    from tests.unit.test_documents import corpus_text

    rng = __import__("random").Random(2)
    src, ev = tmp_path / "docs.jsonl", tmp_path / "eval.jsonl"
    sizes = [rng.choice([30, 2_000, 20_000, 40_000]) for _ in range(14)]
    src.write_text("".join(json.dumps({"text": corpus_text(rng, n, ascii_only=True)}) + "\n" for n in sizes))
    ev.write_text(json.dumps({"text": "held out"}) + "\n")
    extra = json.dumps({"format": "text", "eval": str(ev), "text_overlap_tokens": 4})
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, "-c", KILLABLE, str(src), str(whole), "0", extra],
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)  # fmt: skip
    killed = tmp_path / "killed"
    started = _kill_when(killed, lambda p: p["position"]["offset"] > 100_000, 0.05, src, extra)
    assert started["position"]["offset"] > 100_000, "the second staging went on from where the first was killed"
    assert _staged(killed) == _staged(whole)
    manifest = json.loads(next(whole.glob("datasets/ds-*/manifest.json")).read_text())
    assert manifest["counts"]["cut_documents"] == sum(n > 60 for n in sizes) > 5


def test_a_cache_hit_reads_no_source_bytes_until_the_file_changes(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "d.jsonl"
    src.write_bytes(SAMPLE_DATA.read_bytes())
    past = time.time() - 60
    os.utime(src, (past, past))  # settled: older than fingerprint.SETTLE_S
    tok, data = train_char_tokenizer(), DataConfig(train=str(src), seq_len=64, work_dir=str(tmp_path / "w"))
    first = stage(data, tok, "builtin", str(tmp_path / "s"))
    assert not first.cache_hit and first.sources_read == 1

    def no_reads(*a, **k):
        raise AssertionError("a source was read")

    with monkeypatch.context() as m:
        m.setattr(fingerprint, "hash_file", no_reads)
        m.setattr(staging, "pieces", no_reads)
        again = stage(data, tok, "builtin", str(tmp_path / "s"))
        found = staging.cached(data, tok, str(tmp_path / "s"))  # what a flow asks before provisioning a cluster
    assert again.cache_hit and again.sources_read == 0 and again.dataset_id == first.dataset_id
    assert found is not None and found.dataset_id == first.dataset_id and found.manifest == first.manifest

    os.utime(src, (past + 1, past + 1))  # touched, same bytes: hashed again, still the same dataset
    touched = stage(data, tok, "builtin", str(tmp_path / "s"))
    assert touched.cache_hit and touched.sources_read == 1 and touched.dataset_id == first.dataset_id

    verify = stage(data.model_copy(update={"verify_sources": True}), tok, "builtin", str(tmp_path / "s"))
    assert verify.cache_hit and verify.sources_read == 1


def test_a_file_rewritten_within_one_mtime_tick_is_never_taken_from_the_index(tmp_path: Path) -> None:
    """Same size, same mtime, other bytes: a just-written file is hashed every time, so the change is seen."""
    src = tmp_path / "d.jsonl"
    tok = train_char_tokenizer()
    data = DataConfig(train=str(src), seq_len=64, eval_fraction=0.5, work_dir=str(tmp_path / "w"))
    lines = [json.dumps({"input": f"{i}+{i}=", "target": str(2 * i)}) for i in range(40)]
    src.write_text("\n".join(lines) + "\n")
    stamp = os.stat(src).st_mtime_ns
    first = stage(data, tok, "builtin", str(tmp_path / "s"))
    src.write_text("\n".join(lines[::-1]) + "\n")  # the same size
    os.utime(src, ns=(stamp, stamp))  # and the same mtime, as two writes within one tick get
    second = stage(data, tok, "builtin", str(tmp_path / "s"))
    assert second.dataset_id != first.dataset_id and second.sources_read == 1


def test_two_stagings_of_one_dataset_at_once_never_share_a_spill(tmp_path: Path, monkeypatch) -> None:
    import threading

    monkeypatch.setattr(staging, "BATCH_BYTES", 20_000)  # many batches: the two would interleave without the lock
    tok = train_char_tokenizer()
    data = DataConfig(train=str(SAMPLE_DATA), seq_len=64, shard_mb=0.05, min_shards=2, work_dir=str(tmp_path / "w"))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(stage(data, tok, "b", str(tmp_path / "s"))))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.cache_hit for r in results) == [False, True], "one staged, the other waited and found it staged"
    golden = {k: v for k, v in GOLDEN["pairs-sample"]["files"].items() if k.endswith(".parquet")}
    staged = _staged(tmp_path / "s")
    assert {k: v for k, v in staged.items() if k.endswith(".parquet")} == golden


def test_a_source_replaced_while_it_is_staged_fails_naming_it(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "d.jsonl"
    src.write_bytes(SAMPLE_DATA.read_bytes())
    real = staging.pieces

    def and_then_replace(url, *a, **k):
        yield from real(url, *a, **k)
        src.write_bytes(SAMPLE_DATA.read_bytes() + b'{"input": "1+1=", "target": "2"}\n')  # a writer came by

    monkeypatch.setattr(staging, "pieces", and_then_replace)
    data = DataConfig(train=str(src), seq_len=64, work_dir=str(tmp_path / "w"))
    with pytest.raises(staging.StagingError, match=r"d\.jsonl changed while it was being staged"):
        stage(data, train_char_tokenizer(), "b", str(tmp_path / "s"))
    assert not list((tmp_path / "s").glob("datasets/ds-*/manifest.json")), "nothing staged from a moving file"


def test_a_spill_shorter_than_its_progress_says_is_staged_again_from_the_start(tmp_path: Path, monkeypatch) -> None:
    from ray_jobs.data.spill import Spill

    folder = tmp_path / "spill"
    s = Spill(folder, "ds-x", seq_len=8, pad_id=0)
    s.progress["sizes"]["train.rows"] = 4096  # progress recorded more than reached the disk (a host crash)
    s.progress["file"] = 3
    s._save()
    again = Spill(folder, "ds-x", seq_len=8, pad_id=0)
    assert again.start[0] == 0 and again.rows("train") == 0, "not resumed onto rows that are not there"


def _read_pieces(url: str, size: int, piece_bytes: int) -> list[tuple[int, object]]:
    """Every record of a file read piece by piece as staging does, numbered as lines (rows) of the file."""
    from ray_jobs.data.sources import Position, SourceRange, pieces, read_range

    out, at = [], Position()
    for piece in pieces(url, size, Position(), piece_bytes):
        batch = read_range(piece) if isinstance(piece, SourceRange) else piece
        shift = at.next - 1 if isinstance(piece, SourceRange) else 0
        out += [(n + shift, item) for n, item in batch.items]
        at = Position(batch.end.offset, batch.end.next + shift)
    return out


def test_byte_ranges_own_each_line_exactly_once(tmp_path: Path) -> None:
    """Pieces cut anywhere (mid-line, on a newline, inside a line longer than a piece) read every line of the file
    once, numbered as the file's lines, whatever the piece size."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        lines = [b"x" * int(rng.choice([0, 1, 5, 40, 300])) for _ in range(int(rng.integers(0, 60)))]
        data = b"\n".join(lines) + (b"\n" if trial % 3 else b"")
        f = tmp_path / f"{trial}.jsonl"
        f.write_bytes(data)
        expect = list(enumerate(data.split(b"\n"), start=1))
        if expect and expect[-1][1] == b"" and data.endswith(b"\n") or data == b"":
            expect = expect[:-1]
        for piece_bytes in (1, 7, 64, 1000, 1 << 20):
            assert _read_pieces(str(f), len(data), piece_bytes) == expect, (trial, piece_bytes)


def test_parquet_pieces_follow_row_groups_and_cut_big_ones(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"row {i} " + "y" * (i % 50)} for i in range(1000)]
    f = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=300)
    for piece_bytes in (50, 2000, 30_000, 1 << 30):
        assert _read_pieces(str(f), f.stat().st_size, piece_bytes) == list(enumerate(rows, start=1)), piece_bytes


def test_auto_stages_on_the_cluster_only_big_sources_it_can_read(tmp_path: Path) -> None:
    from ray_jobs.config import load_config
    from tasks.stage import stages_on_cluster

    def cfg(**sets):
        return load_config(
            ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", *(f"{k}={v}" for k, v in sets.items())]
        )

    mb = SAMPLE_DATA.stat().st_size / 1e6
    assert not stages_on_cluster(cfg())  # the demo's small sample: here
    assert stages_on_cluster(cfg(**{"data.cluster_stage_mb": mb / 2}))  # big enough, a local head reads local files
    far = {"data.cluster_stage_mb": mb / 2, "cluster.address": "http://10.0.0.9:8265"}
    assert not stages_on_cluster(cfg(**far)), "a remote cluster cannot read this machine's files"
    assert stages_on_cluster(cfg(**far, **{"data.stage_on": "cluster"})), "unless the user says it can (a shared mount)"
    assert not stages_on_cluster(cfg(**{"data.stage_on": "local", "data.cluster_stage_mb": mb / 2}))
