"""Progress while staging (issue #27): ``unbroken stage`` of a 100 MB file says how far it is every few seconds in
its log and keeps one Prefect progress artifact up to date, read from the session's real Prefect server while the
CLI runs."""

from __future__ import annotations

import contextvars
import re
import threading
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.full(shard=0)]  # a long variant (100 MB): make test-full
DEMO = str(ROOT / "configs" / "demo.yaml")
PROGRESS = re.compile(r"(\d\d:\d\d:\d\d\.\d+) \| INFO .* - staging: (\d+)% \(")
STAGED = re.compile(r"(\d\d:\d\d:\d\d\.\d+) \| INFO .* - staged dataset ")


def big_jsonl(path: Path, mb: int = 100) -> int:
    """``mb`` MB of ``{"input", "target", "note"}`` records of ~4 KB, made by repeating a block of 2,000 distinct
    ones (bytes, no json per record): a tenth of each is tokenized, the rest a field staging reads and skips."""
    block = b"".join(b'{"input": "%d+%d=%s", "target": "%d", "note": "%s"}\n'
                     % (i, i % 97, b"1+2=" * 90, i + i % 97, b"x" * 3200) for i in range(2000))  # fmt: skip
    path.write_bytes(block * ((mb << 20) // len(block) + 1))
    return path.stat().st_size


def _artifact_versions(key: str) -> list[tuple[str, float, str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return [(str(a.id), float(a.data), a.description or "") for a in found]


def test_staging_100_mb_shows_progress_in_the_log_and_the_artifact(tmp_path: Path) -> None:
    """At the default pace (a line every 5 s): never more than 10 s without one."""
    src = tmp_path / "big.jsonl"
    assert big_jsonl(src) >= 100 << 20
    name = f"progress-{uuid.uuid4().hex[:8]}"
    seen: list[tuple[str, float, str]] = []
    stop = threading.Event()

    def watch() -> None:  # the artifact as the UI would show it, while the CLI stages
        while not stop.wait(0.25):
            for version in _artifact_versions(f"{name}-staging"):
                if not seen or seen[-1] != version:
                    seen.append(version)

    # in this context: the Prefect settings that point at the session's server are a context variable
    poller = threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True)
    poller.start()
    sets = {"name": name, "storage": tmp_path / "s", "data.train": src, "data.seq_len": 512, "data.stage_on": "local",
            "model.tiny.max_position_embeddings": 512, "data.work_dir": tmp_path / "work",
            "data.cache_dir": tmp_path / "cache"}  # fmt: skip
    try:
        r = run_cli("stage", DEMO, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    finally:
        stop.set()
        poller.join()
    assert r.returncode == 0, r.explain()
    out = r.stdout + r.stderr
    lines = [(datetime.strptime(t, "%H:%M:%S.%f"), int(p)) for t, p in PROGRESS.findall(out)]
    (staged,) = [datetime.strptime(t, "%H:%M:%S.%f") for t in STAGED.findall(out)]
    # at least one line while it stages (a 100 MB file stages in 8-20 s here, so one to three of them), then 100 %
    assert len(lines) >= 2 and lines[0][1] < 100 and lines[-1][1] == 100, r.explain()
    stamps = [t for t, _ in lines] + [staged]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:], strict=False)]
    assert max(gaps) <= 10, gaps
    assert [p for _, p in lines] == sorted(p for _, p in lines)

    final = _artifact_versions(f"{name}-staging")
    assert len(final) == 1 and final[0][1] == 100.0, final  # one artifact, updated in place to 100
    assert {i for i, _, _ in seen} == {final[0][0]}, seen
    progress = [p for _, p, _ in seen]
    assert len(set(progress)) >= 2 and progress[0] < 100 and progress == sorted(progress), seen  # as the lines
    assert "records" in final[0][2] and "MB/s" in final[0][2], final
