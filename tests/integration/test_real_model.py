"""A real pretrained chat model (SmolLM2-135M-Instruct, tied embeddings, ChatML) through the whole pipeline:
``unbroken run`` on a real local Ray cluster, a LoRA chat fine-tune and a full one on long real documents (HF's
Trainer computing the steps), and a kill -9 of a worker mid-run that still ends bit-identical. Steps are kept few and
short (seq 128, micro-batch 2): a real model costs seconds a step.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from control.backends.base import ClusterHandle
from control.backends.local import start_local_head, stop_local_head
from ray_jobs import checkpoint as ckpt
from ray_jobs.config import load_config
from ray_jobs.storage import Layout
from tests.chaos.harness import (
    REPORT,
    final_weights_hash,
    heartbeat,
    heartbeat_step,
    job_logs,
    kill,
    rank0_pid,
    start_training,
    wait_for,
    wait_job,
)
from tests.conftest import ROOT
from tests.integration.conftest import read_metrics, read_registry, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.full(shard=0)]  # the real-model runs: make test-full
RECIPE = ROOT / "configs" / "smollm2-chat-lora.yaml"
DASHBOARD_PORT, HEAD_PORT = 8295, 6409  # this module's own head, apart from the other suites'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> ClusterHandle:
    storage = tmp_path_factory.mktemp("real-model-cluster")
    cfg = load_config(
        RECIPE, [f"storage={storage}", f"cluster.dashboard_port={DASHBOARD_PORT}", f"cluster.head_port={HEAD_PORT}"]
    )
    handle = start_local_head(cfg)
    assert handle.started_here, "another Ray cluster is already running on this machine"
    yield handle
    stop_local_head(handle)


def overrides(storage: Path, name: str, model: Path, cluster: ClusterHandle, **extra: object) -> list[str]:
    """The recipe, cut down to a few short steps on this module's cluster."""
    base = {
        "name": name,
        "storage": storage,
        "data.cache_dir": storage.parent / "_node_cache",
        "model.name_or_path": model,
        "data.seq_len": 128,
        "train.micro_batch_size": 2,
        "train.max_steps": 4,  # a checkpoint at 2 to kill after, 2 steps to resume, evals at 0, 2, 4
        "train.warmup_steps": 1,
        "train.eval_every_steps": 2,
        "train.eval_max_batches": 2,
        "train.log_every_steps": 1,
        "train.sample_generations": 2,
        "checkpoint.every_steps": 2,
        "checkpoint.num_to_keep": 10,
        "fault_tolerance.heartbeat_every_s": 0.5,
        "cluster.address": cluster.address,
    }
    return [f"{k}={v}" for k, v in (base | extra).items()]


def sets(items: list[str]) -> list[str]:
    return [arg for kv in items for arg in ("--set", kv)]


def assert_loads_and_answers(final: Path) -> str:
    """The exported folder loads with plain transformers and answers a chat prompt; returns the answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings stay tied in the export"
    msgs = [{"role": "user", "content": "What is 21 + 14?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip(), "the fine-tuned model generates text"
    return answer


def assert_eval_loss_fell(storage: Path, name: str) -> None:
    evals = [m["eval_loss"] for m in read_metrics(storage, name) if "eval_loss" in m]
    assert len(evals) >= 2 and evals[-1] < evals[0], f"eval loss must fall: {evals}"


@pytest.fixture(scope="module")
def lora_run(cluster, smollm2, tmp_path_factory) -> tuple[Path, str]:
    """The recipe's LoRA chat fine-tune through ``unbroken run``, uninterrupted: (storage, final-weights hash)."""
    storage = tmp_path_factory.mktemp("lora") / "storage"
    r = run_cli("run", str(RECIPE), *sets(overrides(storage, "lora", smollm2, cluster)))
    assert r.returncode == 0, r.explain()
    final = storage / "runs" / "lora" / "final"
    assert r.last_line == f"final model: {final}"
    assert "before:" in r.stdout and "after:" in r.stdout, r.stdout[-3000:]
    cfg = load_config(RECIPE, overrides(storage, "lora", smollm2, cluster))
    return storage, final_weights_hash(cfg)


def test_lora_chat_finetune_of_the_real_model_end_to_end(lora_run) -> None:
    storage, _ = lora_run
    final = storage / "runs" / "lora" / "final"
    assert_loads_and_answers(final)
    assert_eval_loss_fell(storage, "lora")
    assert read_registry(storage, "lora")["state"] == "succeeded"
    # LoRA checkpoints hold the adapters only: far smaller than the 538 MB of base weights.
    newest = ckpt.list_checkpoints(str(storage / "ray" / "lora"))[0][1]
    assert (Path(newest) / ckpt.MODEL_FILE).stat().st_size < 50e6


def real_documents(path: Path) -> Path:
    """Documentation nobody here wrote, as ``text`` records: every installed package's long description (its
    PyPI README), from under 1 KB to over 100 KB -- most of them far longer than a training sequence."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA"))
    with path.open("w") as f:
        for meta in files:
            f.write(json.dumps({"text": meta.read_text(errors="replace")}) + "\n")
    return path


@pytest.mark.full(shard=1)  # apart from the LoRA runs: the shards cost each lane about the same
def test_full_finetune_with_the_hf_engine_on_long_real_documents_end_to_end(cluster, smollm2, tmp_path) -> None:
    """Continued pre-training of the chat model on real documents longer than ``seq_len``, as a full fine-tune whose
    steps Hugging Face's ``Trainer`` computes (``train.engine: hf``): the documents are cut into pieces, none
    rejected; the export loads, stays tied and answers; eval loss falls. (One run for both: a real model costs
    minutes a run on two cores; LoRA through ``unbroken run`` is the module's other run.)"""
    storage = tmp_path / "storage"
    full = {"model.lora": "null", "train.lr": 5e-5, "train.engine": "hf", "train.max_steps": 4,
            "train.eval_every_steps": 2, "checkpoint.every_steps": 0, "train.sample_generations": 0,
            "data.train": real_documents(tmp_path / "docs.jsonl"), "data.format": "text", "data.eval_fraction": 0.2,
            "data.text_overlap_tokens": 16}  # fmt: skip
    r = run_cli("run", str(RECIPE), *sets(overrides(storage, "full", smollm2, cluster, **full)))
    assert r.returncode == 0, r.explain()
    assert read_registry(storage, "full")["config"]["train"]["engine"] == "hf"
    (manifest,) = storage.glob("datasets/ds-*/manifest.json")
    counts = json.loads(manifest.read_text())["counts"]
    assert counts["rejects"] == 0 and counts["cut_documents"] > counts["documents"] // 2, counts
    assert re.search(r"\d+ documents -> \d+ pieces \(\d+ cut", r.stdout + r.stderr), r.explain()
    assert_loads_and_answers(storage / "runs" / "full" / "final")
    assert_eval_loss_fell(storage, "full")


def test_kill_9_of_a_worker_on_the_real_model_ends_bit_identical(cluster, smollm2, lora_run, tmp_path) -> None:
    _, uninterrupted = lora_run
    cfg = load_config(RECIPE, overrides(tmp_path / "storage", "lora-kill9", smollm2, cluster))
    sid = start_training(cluster, cfg)
    ckpts = Layout(cfg.storage).checkpoints_dir(cfg.name)
    # A valid one (manifest written): a kill during the first write would leave nothing to resume from.
    wait_for("the first valid checkpoint", lambda: ckpt.find_latest_valid(ckpts), timeout_s=300, every_s=0.2)
    victim, at_kill, killed_at = rank0_pid(cfg), heartbeat_step(cfg), time.time()
    kill(victim, signal.SIGKILL)

    assert wait_job(cluster, sid, timeout_s=600) == "SUCCEEDED", job_logs(cluster, sid)[-5000:]
    logs = job_logs(cluster, sid)
    assert re.search(r"resumed from \S+checkpoint-step-\d{8} at step \d+", logs), logs[-5000:]
    beat = heartbeat(cfg)
    assert beat["pid"] != victim and beat["started_step"] < cfg.train.max_steps
    REPORT.append({"scenario": "kill -9 a worker (SmolLM2 LoRA)", "detected_by": "Ray Train (in job)",
                   "detection_s": None, "recovery_s": beat["first_step_at"] - killed_at,
                   "lost_steps": max(0, at_kill - beat["started_step"])})  # fmt: skip
    assert final_weights_hash(cfg) == uninterrupted


@pytest.mark.full(shard=0)  # beside the LoRA runs: the real-model tests spread over two shards
def test_dpo_of_the_real_model_end_to_end(cluster, smollm2, tmp_path) -> None:
    """DPO (TRL's DPOTrainer on the hf engine) with LoRA on the real chat model through ``unbroken run``: the JSON
    answer chosen over the prose one (configs/smollm2-chat-dpo.yaml); DPO's held-out loss starts at ln 2 (the policy
    is the reference: the base, adapters disabled) and falls, the reward accuracy is logged, the export answers."""
    import math

    storage, recipe = tmp_path / "storage", ROOT / "configs" / "smollm2-chat-dpo.yaml"
    dpo = {"data.train": ROOT / "configs" / "data" / "chat_preferences.jsonl", "data.format": "preference",
           "train.engine": "hf", "train.method": "dpo", "train.hf_args": "{beta: 0.1}", "train.lr": 5e-4,
           "data.seq_len": 256, "train.max_steps": 2, "train.warmup_steps": 0}  # fmt: skip
    r = run_cli("run", str(recipe), *sets(overrides(storage, "dpo", smollm2, cluster, **dpo)))
    assert r.returncode == 0, r.explain()
    evals = [m for m in read_metrics(storage, "dpo") if "eval_loss" in m]
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-4), evals
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and "eval_reward_accuracy" in evals[-1], evals
    assert_loads_and_answers(storage / "runs" / "dpo" / "final")
