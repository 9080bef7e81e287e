"""The node's model cache is a cache, not a gamble: a model folder on storage is downloaded once per node under a
lock, verified, renamed into place whole; a copy that is not intact is never loaded but fetched again; a download
killed mid-way leaves nothing anyone loads; the shard cache never evicts it.

Storage here is ``slowtest://``: the local disk behind a protocol ``is_local`` does not know (so it is downloaded,
as from s3://), whose copies are counted and can be made slow, short, or to hang until killed."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from ray_jobs.contracts.dataset import Shard
from ray_jobs.data.cache import ShardCache
from ray_jobs.model.cache import MARKER, MODELS_DIR, SOURCE_MANIFEST, ModelCacheError, cached_folder, problem
from ray_jobs.model.loading import local_folder
from ray_jobs.storage import Layout

GETS = "UNBROKEN_TEST_MODEL_GETS"  # a file each copy from storage appends its source path to
MODE = "UNBROKEN_TEST_MODEL_MODE"  # "slow": each copy takes a while; "short": copies stop short; "hang": until killed
CHUNK = 1000
_started: threading.Event | None = None  # set by a copy in "hang" mode once it wrote its first chunk


class SlowTestFS(LocalFileSystem):
    """The local disk as a remote store: copies are counted in ``$GETS`` and shaped by ``$MODE``."""

    protocol = ("slowtest",)

    def get_file(self, rpath, lpath, callback=None, **kwargs) -> None:
        if os.path.isdir(rpath):  # a folder, from a recursive get
            os.makedirs(lpath, exist_ok=True)
            return
        with open(os.environ[GETS], "a") as log:
            log.write(rpath + "\n")
        mode = os.environ.get(MODE, "")
        with open(rpath, "rb") as src, open(lpath, "wb") as dst:
            dst.write(src.read(CHUNK))
            dst.flush()
            if mode == "hang":
                _started.set()
                threading.Event().wait()  # until kill -9
            if mode == "slow":
                time.sleep(0.1)  # every rank of the node is asking meanwhile
            if mode != "short":
                shutil.copyfileobj(src, dst)


fsspec.register_implementation("slowtest", SlowTestFS, clobber=True)

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": bytes(i * 7919 % 251 for i in range(50_000)),
         "tokenizer/tokenizer.json": b"{}" * 3000}  # fmt: skip


@pytest.fixture
def model(tmp_path: Path, monkeypatch) -> tuple[str, Path]:
    """A model folder on ``slowtest://`` storage and the node's cache root; copies counted in ``gets(tmp_path)``."""
    src = tmp_path / "storage" / "models" / "base"
    for rel, data in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    monkeypatch.setenv(GETS, str(tmp_path / "gets.log"))
    monkeypatch.delenv(MODE, raising=False)
    return f"slowtest://{src}", tmp_path / "node-cache"


def gets(tmp_path: Path) -> list[str]:
    log = tmp_path / "gets.log"
    return sorted(Path(p).name for p in log.read_text().split()) if log.exists() else []


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def assert_whole(folder: Path) -> None:
    """The folder holds exactly the model's files, byte for byte, and its marker."""
    found = files_of(folder)
    assert json.loads(found.pop(MARKER))["files"].keys() == FILES.keys()
    assert found == FILES


def _fetch(url: str, cache_root: str, go, out) -> None:
    go.wait()
    try:
        out.put(local_folder(url, cache_root))
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def test_ranks_of_one_node_fetching_at_once_download_the_model_once(model, tmp_path, monkeypatch) -> None:
    url, cache_root = model
    monkeypatch.setenv(MODE, "slow")  # the download takes long enough that every rank asks while it runs
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    ranks = [ctx.Process(target=_fetch, args=(url, str(cache_root), go, out)) for _ in range(4)]
    for p in ranks:
        p.start()
    go.set()
    folders = {out.get(timeout=60) for _ in ranks}
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0
    assert gets(tmp_path) == sorted(Path(f).name for f in FILES), "each file copied from storage once"
    assert len(folders) == 1, folders
    (folder,) = folders
    assert Path(folder).parent == cache_root / MODELS_DIR
    assert_whole(Path(folder))


def _fetch_hanging(url: str, cache_root: str, started) -> None:
    global _started
    _started = started
    os.environ[MODE] = "hang"
    local_folder(url, cache_root)


def test_a_download_killed_mid_way_is_never_loaded_and_the_next_fetch_copies_it_whole(model, tmp_path) -> None:
    url, cache_root = model
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    rank = ctx.Process(target=_fetch_hanging, args=(url, str(cache_root), started))
    rank.start()
    try:
        assert started.wait(60), "the download began"
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(30)
    assert rank.exitcode == -signal.SIGKILL
    models = cache_root / MODELS_DIR
    (digest,) = {p.name.split(".")[0] for p in models.iterdir()}
    assert not (models / digest).exists(), "nothing in place to load"
    assert list(models.glob(f"{digest}.tmp-*")), "the killed download's half-made copy is beside it"
    assert problem(models / digest, url) == "not cached"

    folder = cached_folder(url, cache_root)  # the dead rank's lock was released with it
    assert folder == models / digest
    assert_whole(folder)
    assert not list(models.glob(f"{digest}.tmp-*")), "its leftover was removed"


def _truncate(folder: Path) -> None:
    with (folder / "model.safetensors").open("r+b") as f:
        f.truncate(1000)


def _rewrite_same_size(folder: Path) -> None:
    p = folder / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    os.utime(p, ns=(1, 1))  # another modification time, as a rewrite leaves (one within the clock's tick might not)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        pytest.param(_truncate, "model.safetensors is 1000 bytes, 50000 were verified", id="truncated"),
        pytest.param(lambda f: (f / "config.json").unlink(), "missing config.json", id="file-missing"),
        pytest.param(
            lambda f: (f / "stray.bin").write_bytes(b"x"), "not vouched for by its marker: stray.bin", id="extra-file"
        ),
        pytest.param(_rewrite_same_size, "model.safetensors was rewritten since it was verified", id="rewritten"),
        pytest.param(lambda f: (f / MARKER).unlink(), "no marker: its download never finished", id="no-marker"),
        pytest.param(lambda f: (f / MARKER).write_text("{"), "its marker is unreadable", id="marker-cut"),
    ],
)
def test_a_damaged_copy_is_detected_removed_and_fetched_again(model, tmp_path, damage, why) -> None:
    url, cache_root = model
    folder = cached_folder(url, cache_root)
    assert problem(folder, url) is None
    damage(folder)
    assert why in problem(folder, url)
    assert cached_folder(url, cache_root) == folder
    assert_whole(folder)
    assert len(gets(tmp_path)) == 2 * len(FILES), "fetched again, whole"


def test_an_intact_copy_is_used_as_it_is_and_a_touched_but_unchanged_file_keeps_it(model, tmp_path) -> None:
    url, cache_root = model
    folder = cached_folder(url, cache_root)
    os.utime(folder / "model.safetensors", ns=(1, 1))  # a new modification time, the same bytes: hashed, kept
    assert cached_folder(url, cache_root) == folder
    assert len(gets(tmp_path)) == len(FILES), "no second download"
    assert json.loads((folder / MARKER).read_text())["sha256_from"] == "computed on this node after the download"


def test_a_model_published_again_at_the_same_url_is_fetched_again(model, tmp_path) -> None:
    """A base model republished (or a ``final`` exported again) at the same URL, the same sizes, other bytes: the node's
    copy is of the old one and is fetched again -- it was keyed on the URL alone and served stale. Unchanged on
    storage, the copy is used as it is."""
    url, cache_root = model
    src = Path(url.removeprefix("slowtest://"))
    folder = cached_folder(url, cache_root)
    assert cached_folder(url, cache_root) == folder and len(gets(tmp_path)) == len(FILES), "unchanged: used as is"
    new_weights = bytes(reversed(FILES["model.safetensors"]))
    (src / "model.safetensors").write_bytes(new_weights)  # republished: same size, other bytes
    os.utime(src / "model.safetensors", ns=(2_000_000_000, 2_000_000_000))  # (a store's new version marker)
    assert (cached_folder(url, cache_root) / "model.safetensors").read_bytes() == new_weights
    assert len(gets(tmp_path)) == 2 * len(FILES), "fetched again, whole"


def _manifest(src: Path, **changes: str) -> None:
    sums = {rel: hashlib.sha256(data).hexdigest() for rel, data in FILES.items()} | changes
    (src / SOURCE_MANIFEST).write_text(json.dumps({k: v for k, v in sums.items() if v}))


def test_a_copy_is_checked_against_the_sources_manifest_when_it_has_one(model) -> None:
    url, cache_root = model
    _manifest(Path(url.removeprefix("slowtest://")))
    folder = cached_folder(url, cache_root)
    record = json.loads((folder / MARKER).read_text())
    assert record["sha256_from"] == SOURCE_MANIFEST
    assert record["files"]["config.json"]["sha256"] == hashlib.sha256(FILES["config.json"]).hexdigest()


@pytest.mark.parametrize(
    ("mode", "changes", "error"),
    [
        ("", {"config.json": "0" * 64}, "sha256 of config.json does not match sha256.json"),
        ("", {"config.json": ""}, "sha256.json does not match the folder: not vouched for by sha256.json: config.json"),
        ("", {"gone.bin": "0" * 64}, "sha256.json does not match the folder: missing gone.bin"),
        ("short", {}, "the copy does not match the listing: model.safetensors: 1000 bytes, storage lists 50000; "
                      "tokenizer/tokenizer.json: 1000 bytes, storage lists 6000"),
    ],
    ids=["sha256-differs", "file-not-in-manifest", "manifest-names-a-missing-file", "copy-cut-short"],
)  # fmt: skip
def test_a_copy_unlike_its_listing_or_manifest_is_refused_and_nothing_is_left(model, monkeypatch, mode, changes,
                                                                              error) -> None:  # fmt: skip
    url, cache_root = model
    _manifest(Path(url.removeprefix("slowtest://")), **changes)
    monkeypatch.setenv(MODE, mode)
    with pytest.raises(ModelCacheError) as raised:
        cached_folder(url, cache_root)
    assert error in str(raised.value)
    assert [p.suffix for p in (cache_root / MODELS_DIR).iterdir()] == [".lock"], "nothing left but the lock file"


@pytest.mark.parametrize(
    ("name_or_path", "expected"),
    [
        ("/data/models/base", "/data/models/base"),
        ("file:///data/models/base", "/data/models/base"),
        ("./models/base", "./models/base"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ],
)
def test_local_paths_and_hub_ids_are_not_copied(tmp_path: Path, name_or_path: str, expected: str) -> None:
    assert local_folder(name_or_path, tmp_path / "node-cache") == expected
    assert not (tmp_path / "node-cache").exists()


def test_the_shard_cache_never_evicts_the_nodes_model_cache(model, tmp_path) -> None:
    url, cache_root = model
    folder = local_folder(url, cache_root)
    old_dataset = cache_root / "ds-old" / "train-0.parquet"
    old_dataset.parent.mkdir()
    old_dataset.write_bytes(b"x" * 10_000)
    os.utime(cache_root / MODELS_DIR, (1, 1))  # both long unused, the model cache the least recently
    os.utime(cache_root / "ds-old", (2, 2))
    shard = b"s" * 5_000
    storage = tmp_path / "storage"
    Path(Layout(str(storage)).dataset_dir("ds-new")).mkdir(parents=True)
    (Path(Layout(str(storage)).dataset_dir("ds-new")) / "train-0.parquet").write_bytes(shard)
    cache = ShardCache(str(storage), "ds-new", str(cache_root), max_bytes=1_000)  # less than the model alone
    entry = Shard(file="train-0.parquet", rows=1, bytes=len(shard), sha256=hashlib.sha256(shard).hexdigest())
    assert cache.local_path(entry).read_bytes() == shard
    assert cache.evicted == ["ds-old"]
    assert problem(Path(folder), url) is None


def test_dpo_reads_its_tokenizer_from_the_nodes_model_cache_not_a_copy_in_the_temp_folder(
    tmp_path, monkeypatch
) -> None:
    """A base model on storage is copied once per node into ``data.cache_dir``; DPO's tokenizer came from a second
    copy of the whole folder in the system temp folder."""
    import tempfile
    from types import SimpleNamespace

    from ray_jobs.config import load_config
    from ray_jobs.config.methods import METHODS
    from ray_jobs.model.builtin import build_builtin
    from ray_jobs.train.trl_methods import construction
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}", f"data.cache_dir={tmp_path / 'node'}"])
    src = build_builtin(cfg.model, 0, tmp_path / "storage" / "models" / "tiny")
    monkeypatch.setenv(GETS, str(tmp_path / "gets.log"))
    monkeypatch.delenv(MODE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "system-temp"))
    (tmp_path / "system-temp").mkdir()
    owner = SimpleNamespace(model_path=f"slowtest://{src}", cfg=cfg, lora=True, method=METHODS["dpo"])
    assert construction(owner)["processing_class"] is not None
    assert list((tmp_path / "node" / MODELS_DIR).glob("*/tokenizer_config.json")), "the node's one copy"
    assert not (tmp_path / "system-temp" / MODELS_DIR).exists(), "no second copy in the temp folder"
