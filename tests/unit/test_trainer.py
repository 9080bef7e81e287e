"""The training loop in-process (LocalRuntime): it learns, resumes exactly, trusts only verified checkpoints,
and exports loadable HF folders (full and LoRA)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import pytest

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, load_config
from ray_jobs.contracts.dataset import DatasetManifest
from ray_jobs.contracts.job_spec import AttemptInputs
from ray_jobs.data.staging import stage
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import load_tokenizer
from ray_jobs.storage import Layout
from ray_jobs.train.runtime import DrainNotice, LocalRuntime
from ray_jobs.train.trainer import Trainer
from tests.conftest import ROOT, made_manifest, tiny_overrides


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("trainer") / "storage"
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        tiny_overrides(
            storage, **{"train.lr": 0.01, "train.warmup_steps": 3, "fault_tolerance.heartbeat_every_s": 0.2}
        ),
    )
    return cfg, *staged_builtin(cfg)


def staged_builtin(cfg: Config) -> tuple[dict, str]:
    """The config's built-in model, built beside its storage (``<storage>/../base``), and its data staged with that
    model's tokenizer: (manifest, model folder)."""
    model = str(Path(cfg.storage).parent / "base")
    build_builtin(cfg.model, cfg.train.seed, model)
    return stage(cfg.data, load_tokenizer(model), model, cfg.storage).manifest, model


def named(cfg: Config, name: str, **train: object) -> Config:
    c = cfg.model_copy(deep=True)
    c.name = name
    for k, v in train.items():
        section, key = k.split("__")
        setattr(getattr(c, section), key, v)
    return c


def weights_hash(trainer: Trainer) -> str:
    state = trainer.model.state_dict()
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def train(cfg: Config, manifest: dict, model: str, stop_at: int | None = None) -> Trainer:
    t = Trainer(cfg, manifest, model, LocalRuntime())
    t.resume_or_start()
    t.fit(stop_at=stop_at)
    return t


def checkpoints(cfg: Config) -> list[tuple[int, str]]:
    return ckpt.list_checkpoints(Layout(cfg.storage).checkpoints_dir(cfg.name))


def test_eval_loss_falls_and_metrics_and_heartbeat_are_written(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "learns")
    t = train(c, manifest, model)
    rows = t.metrics.rows
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 10, 20, 30]
    assert evals[-1] < evals[0] * 0.7
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen"} <= set(rows[-1])
    beat = json.loads(Path(Layout(c.storage).heartbeat(c.name)).read_text())
    assert beat["step"] == 30 and beat["max_steps"] == 30
    assert beat["time"] >= beat["last_step_at"] > 0 and beat["pid"] > 0


def test_checkpoints_have_manifests_and_are_reported_once_each(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "ckpts")
    t = train(c, manifest, model)
    assert [s for s, _ in checkpoints(c)] == [30, 20, 10]
    for _, url in checkpoints(c):
        files = ckpt.read_verified(url)
        assert set(files) == {"model.safetensors", "optim.pt", "state.json", "rank-00000.json"}
    reported = [(m["step"], url) for m, url in t.rt.reports]
    assert [s for s, _ in reported] == [10, 20, 30]
    assert all(url and url.endswith(ckpt.checkpoint_name(s)) for s, url in reported)
    assert len(t.checkpointer.stalls_s) == 3


@pytest.mark.parametrize("async_write", [True, False])
def test_stopped_and_resumed_run_is_bit_identical(setup, async_write: bool) -> None:
    cfg, manifest, model = setup
    straight = weights_hash(
        train(named(cfg, f"straight-{str(async_write).lower()}", checkpoint__async_write=async_write), manifest, model)
    )
    c = named(cfg, f"cut-{str(async_write).lower()}", checkpoint__async_write=async_write)
    cut = train(c, manifest, model, stop_at=25)  # checkpoints at 10 and 20, then "dies" at 25
    assert cut.loop.step == 25 and weights_hash(cut) != straight
    resumed = train(c, manifest, model)
    assert resumed.resumed_from.endswith(ckpt.checkpoint_name(20))
    assert resumed.loop.step == 30
    assert weights_hash(resumed) == straight
    logged = [r["step"] for r in resumed.metrics.rows]
    assert logged == sorted(set(logged)), "metrics.jsonl holds each step once after a resume"


def test_resume_deep_into_an_epoch_builds_no_batch_for_skipped_rows(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "deep", train__max_steps=31)
    train(c, manifest, model, stop_at=30)
    resumed = Trainer(c, manifest, model, LocalRuntime())
    resumed.resume_or_start()
    assert all(cur.pos > 0 for cur in resumed.cursors), "the resume point is inside an epoch"
    assert resumed.rows_materialized == 0
    resumed.fit()
    # one step: the global batch (2 data ranks, run by the one worker here), nothing for the skipped rows
    assert resumed.rows_materialized == c.train.micro_batch_size * c.train.grad_accum_steps * 2


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]), "is 100 bytes"),
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (
            lambda d: (d / "manifest.json").write_text(
                json.dumps(  # hand-edited: a model field and the version garbled
                    {**json.loads((d / "manifest.json").read_text()), "schema_version": "x"}
                )
            ),
            "not a version number",
        ),
    ],
    ids=["truncated-file", "missing-manifest", "garbled-manifest"],
)
def test_a_damaged_newest_checkpoint_is_skipped_saying_why(setup, caplog, damage, reason: str) -> None:
    cfg, manifest, model = setup
    c = named(cfg, f"damaged-{reason.split()[0]}")
    train(c, manifest, model)
    newest = Path(checkpoints(c)[0][1])
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint"):
        t = Trainer(c, manifest, model, LocalRuntime())
        t.resume_or_start()
    assert t.loop.step == 20 and t.resumed_from.endswith(ckpt.checkpoint_name(20))
    assert any(str(newest) in r.message and reason in r.message for r in caplog.records), caplog.text


def test_an_explicit_damaged_checkpoint_is_refused(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "explicit")
    train(c, manifest, model, stop_at=10)
    url = checkpoints(c)[0][1]
    (Path(url) / "optim.pt").write_bytes(b"garbage")
    t = Trainer(c, manifest, model, LocalRuntime())
    with pytest.raises(ckpt.CheckpointInvalid, match="optim.pt"):
        t.resume_or_start(explicit_checkpoint=url)


def _load_and_generate(final: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in final.iterdir()}
    tok = AutoTokenizer.from_pretrained(final)
    lm = AutoModelForCausalLM.from_pretrained(final)
    out = lm.generate(**tok("<s>12+3=", add_special_tokens=False, return_tensors="pt"), max_new_tokens=3)
    return tok.decode(out[0])


def test_full_run_exports_a_folder_that_loads_and_generates_and_writes_its_samples(setup) -> None:
    """The export, then (the finetune flow's attempts ask for it) the held-out samples the summarize task publishes:
    written by the job, so the flow loads no model."""
    from tasks.report import read_samples

    cfg, manifest, model = setup
    c = named(cfg, "export-full", train__sample_generations=4)
    t = train(c, manifest, model)
    # a remote cluster's job, its data staged from the flow's host: the raw source is not there, the staged split is
    t.cfg.data.train = "/the-flows-host/only/addition.jsonl"
    final = Path(t.export_final(samples=True))
    assert _load_and_generate(final).startswith("<s>12+3=")
    card = (final / "README.md").read_text()
    assert manifest.dataset_id in card and "eval loss at step 0" in card and "full fine-tune" in card
    assert json.loads((final / "config.json").read_text())["model_type"] == "llama"
    samples = read_samples(c)
    assert len(samples) == 4 and all(x["prompt"] and x["target"] for x in samples)
    assert [x["exact"] for x in samples] == [x["output"].strip() == x["target"].strip() for x in samples]
    assert json.loads(Path(Layout(c.storage).samples(c.name)).read_text())["final_model"] == str(final)


def test_samples_that_cannot_be_made_are_a_warning_and_the_trained_run_is_exported(setup, monkeypatch, caplog) -> None:
    """Anything after the export fails the samples alone: the job neither fails nor retries (a retried group would
    export again and fail again), the final model is on storage, and no samples file claims otherwise."""
    import logging

    from ray_jobs.train import samples

    def broken(*a, **k):
        raise RuntimeError("CUDA out of memory while loading the base model")

    cfg, manifest, model = setup
    c = named(cfg, "export-no-samples", train__sample_generations=4)
    t = train(c, manifest, model)
    monkeypatch.setattr(samples, "generate_samples", broken)
    with caplog.at_level(logging.WARNING, logger="unbroken.samples"):
        final = t.export_final(samples=True)
    assert final and Path(final, "model.safetensors").exists()
    assert not Path(Layout(c.storage).samples(c.name)).exists()
    assert "no sample generations: RuntimeError: CUDA out of memory" in caplog.text


def test_lora_run_trains_adapters_only_resumes_exactly_and_exports_merged(setup) -> None:
    cfg, manifest, model = setup
    lora = {"model.lora.r": 4, "model.lora.target_modules": "[q_proj, k_proj, v_proj, o_proj]"}
    c = load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(Path(cfg.storage), name="lora", **lora))
    straight = train(c, manifest, model)
    trainable = {n for n, p in straight.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    saved = ckpt.decode(ckpt.read_verified(checkpoints(c)[0][1]))[0]
    assert set(saved) == trainable, "a LoRA checkpoint holds the adapter weights only"

    c2 = c.model_copy(deep=True)
    c2.name = "lora-cut"
    train(c2, manifest, model, stop_at=15)
    assert weights_hash(train(c2, manifest, model)) == weights_hash(straight)

    final = Path(straight.export_final())
    assert "lora" not in (final / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    assert _load_and_generate(final).startswith("<s>12+3=")
    assert "LoRA r=4, merged" in (final / "README.md").read_text()


def test_time_based_cadence_checkpoints_without_a_step_schedule(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "by-time", checkpoint__every_steps=0, checkpoint__every_minutes=1e-6)
    t = train(c, manifest, model)
    steps = sorted(s for s, _ in checkpoints(c))
    assert len(steps) > 3 and steps[-1] == 30, "every step is past a 60 us interval; the last step always counts"
    assert [m["step"] for m, _ in t.rt.reports] == steps, "each checkpoint is reported to the platform once"


def test_bf16_autocast_and_gradient_checkpointing_train(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "bf16", train__precision="bf16", train__gradient_checkpointing=True)
    t = train(c, manifest, model)
    evals = [r["eval_loss"] for r in t.metrics.rows if "eval_loss" in r]
    assert evals[-1] < evals[0]
    assert t.model.is_gradient_checkpointing
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in t.model.parameters()), "weights stay fp32"


def test_a_drain_notice_checkpoints_the_current_step_once_and_changes_no_number(setup, caplog) -> None:
    """Ray Train's notice (polled every preemption_poll_s, here every step) makes every rank checkpoint the step it
    is at, then wait for the restart; a restart that never comes (the deadline long past) lets training go on."""
    cfg, manifest, model = setup
    plain = train(named(cfg, "no-notice"), manifest, model)
    c = named(cfg, "notice", fault_tolerance__preemption_poll_s=1e-6)
    rt = LocalRuntime()
    past = (time.time() - c.fault_tolerance.preemption_grace_s - 61) * 1000  # no waiting in a unit test
    asked: list[int] = []
    t = Trainer(c, manifest, model, rt)

    def notice():
        asked.append(t.loop.step + 1)  # asked in the step's agreement, before the step counts as done
        return DrainNotice(past, {"ab" * 28: [1]}) if len(asked) >= 7 else None

    rt.preemption_notice = notice
    t.resume_or_start()
    with caplog.at_level(logging.WARNING, logger="unbroken.train"):
        t.fit()
    assert asked[:8] == list(range(1, 9)), "asked at every step boundary"
    jit = [r.getMessage() for r in caplog.records if "just-in-time" in r.getMessage()]
    assert len(jit) == 1 and "at step 7 saved (drain notice for node(s) abababababab" in jit[0]
    assert 7 in [s for s, _ in checkpoints(c)] and 7 % c.checkpoint.every_steps != 0
    assert weights_hash(t) == weights_hash(plain)


def test_job_maps_retention_and_preemption_settings_onto_ray_train() -> None:
    from ray_jobs.job import build_trainer, worker_config

    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["storage=/tmp/x", "checkpoint.num_to_keep=4", "checkpoint.keep_best_by=eval_loss",
         "fault_tolerance.max_failures=5", "fault_tolerance.preemption_grace_s=12",
         "fault_tolerance.max_preemptions=7"],
    )  # fmt: skip
    loop = worker_config(cfg, made_manifest(), AttemptInputs(manifest_url="/d/manifest.json", model_path="/m"))
    trainer = build_trainer(cfg, loop)
    run = trainer.run_config
    assert run.name == "demo" and run.storage_path == "/tmp/x/ray"
    assert run.checkpoint_config.num_to_keep == 4
    assert run.checkpoint_config.checkpoint_score_attribute == "eval_loss"
    assert run.failure_config.max_failures == 5
    assert run.failure_config.max_preemption_failures == 7, "preemptions have their own budget"
    assert trainer.scaling_config.num_workers == 2
    elastic = cfg.model_copy(deep=True)
    elastic.cluster.num_workers, elastic.cluster.resize_check_s = {"min": 1, "max": 2}, 15
    scaling = build_trainer(elastic, loop).scaling_config
    assert (scaling.min_workers, scaling.max_workers, scaling.elastic_resize_monitor_interval_s) == (1, 2, 15)
    assert trainer.backend_config.preemption_grace_s == 12 and trainer.backend_config.backend == "gloo"


def _tiny_tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config)


def test_a_tied_embedding_is_stored_once_and_retied_on_load_while_missing_weights_still_fail() -> None:
    import torch

    src, dst = _tiny_tied_llama(), _tiny_tied_llama()
    assert ckpt.tied_aliases(src) == {"lm_head.weight": "model.embed_tokens.weight"}
    sd = ckpt.model_state(src, fsdp=False, trainable_only=False)
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    load = __import__("safetensors.torch", fromlist=["load"]).load
    ckpt.load_model_state(dst, load(ckpt.encode_file("safetensors", sd)), False, False)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight, "loading keeps the tie"
    assert torch.equal(dst.lm_head.weight, src.lm_head.weight)
    sd.pop("model.embed_tokens.weight")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model\.embed_tokens\.weight"):
        ckpt.load_model_state(dst, sd, fsdp=False, trainable_only=False)


# -- phases and the resume decision --------------------------------------------------------------------------
class PhaseLog:
    """Every heartbeat write, in order (a phase change wakes the side thread at once, not at the next beat)."""

    def __init__(self, monkeypatch):
        from ray_jobs.train import heartbeat

        self.writes: list[dict] = []
        real = heartbeat.write_json_atomic
        monkeypatch.setattr(
            heartbeat, "write_json_atomic", lambda url, body: (self.writes.append(body), real(url, body))
        )

    def phases(self) -> list[str]:
        out: list[str] = []
        for w in self.writes:
            if not out or out[-1] != w["phase"]:
                out.append(w["phase"])
        return out


def test_the_heartbeat_reports_each_phase_as_it_starts(setup, monkeypatch) -> None:
    from ray_jobs import faults
    from ray_jobs.train.heartbeat import start_heartbeat

    cfg, manifest, model = setup
    c = named(cfg, "phases", fault_tolerance__heartbeat_every_s=60.0)  # only phase changes write
    # Writes are asynchronous (training never waits on storage): a phase of a few milliseconds may be overtaken by
    # the next before the side thread writes it. Each phase's first entry lasts 0.3 s here, so each is seen.
    monkeypatch.setenv(faults.ENV, "evaluating:0.3,training:0.3,checkpointing:0.3,exporting:0.3")
    monkeypatch.setattr(faults, "_done", set())
    beats = PhaseLog(monkeypatch)
    hb = start_heartbeat(c, attempt=3)
    t = Trainer(c, manifest, model, LocalRuntime(), hb)
    t.resume_or_start()
    t.fit()
    t.export_final()
    hb.stop()
    every_change = [
        "loading", "evaluating", "training", "evaluating", "training", "evaluating", "training",
        "evaluating", "training", "checkpointing", "training", "exporting", "done",
    ]  # fmt: skip
    seen = beats.phases()
    assert list(dict.fromkeys(seen)) == ["loading", "evaluating", "training", "checkpointing", "exporting", "done"]
    rest = iter(every_change)
    assert all(p in rest for p in seen), f"{seen} is not in the order the job moves: {every_change}"
    assert beats.writes[0]["step"] == 0 and beats.writes[0]["attempt"] == 3  # before the model was even built
    last = beats.writes[-1]
    assert last["step"] == 30 and last["phase"] == "done" and last["phase_started_at"] <= last["time"]


def test_an_injected_delay_makes_a_phase_long_while_the_heartbeat_keeps_beating(setup, monkeypatch) -> None:
    from ray_jobs import faults
    from ray_jobs.train.heartbeat import start_heartbeat

    cfg, manifest, model = setup
    c = named(cfg, "slow-export", fault_tolerance__heartbeat_every_s=0.1)
    monkeypatch.setenv(faults.ENV, "exporting:1.0")
    monkeypatch.setattr(faults, "_done", set())
    beats = PhaseLog(monkeypatch)
    hb = start_heartbeat(c, attempt=1)
    t = Trainer(c, manifest, model, LocalRuntime(), hb)
    t.resume_or_start()
    t.fit()
    t.export_final()
    hb.stop()
    exporting = [w for w in beats.writes if w["phase"] == "exporting"]
    assert exporting[-1]["time"] - exporting[0]["phase_started_at"] >= 0.9
    assert len(exporting) >= 5, "beats go on inside a long phase (a frozen process would stop them)"


def test_malformed_fault_injection_is_an_error() -> None:
    from ray_jobs import faults

    assert faults.delays("exporting:25, step:0.1") == {"exporting": 25.0, "step": 0.1}
    assert faults.delays("") == {}
    with pytest.raises(ValueError, match="phase:seconds"):
        faults.delays("exporting")


def test_a_delay_file_adds_to_the_variable_and_is_read_again_when_it_changes(tmp_path, monkeypatch) -> None:
    from ray_jobs import faults

    spec = tmp_path / "delay"
    spec.write_text("step:0.5\n")
    monkeypatch.setenv(faults.ENV, "exporting:2")
    monkeypatch.setenv(faults.FILE_ENV, str(spec))
    assert faults.delays() == {"exporting": 2.0, "step": 0.5}
    spec.write_text("step:0.25,evaluating:1\n")  # a running job's next step sees the new spec
    assert faults.delays() == {"exporting": 2.0, "step": 0.25, "evaluating": 1.0}
    spec.unlink()  # gone: the variable's alone
    assert faults.delays() == {"exporting": 2.0}


@pytest.mark.parametrize(
    ("valid", "explicit", "chosen", "why"),
    [
        ([10, 20, 30], None, 30, "the newest valid"),
        ([10, 20], 20, 20, "named for this attempt"),  # an attempt's first start
        ([20, 30, 40], 20, 40, "newer than"),  # after in-job restarts: never back to the explicit one
        ([10, 30], 20, 30, "newer than"),  # the explicit one was deleted by retention
        ([], None, None, "no valid"),
    ],
)
def test_the_resume_decision_treats_an_explicit_checkpoint_as_a_floor(tmp_path, valid, explicit, chosen, why) -> None:
    from ray_jobs.train.resume import choose_resume

    folder = tmp_path / "ckpts"
    for step in (10, 20, 30, 40):
        (folder / ckpt.checkpoint_name(step)).mkdir(parents=True)

    def verify(url):
        if ckpt.checkpoint_step(url) not in valid:
            raise ckpt.CheckpointInvalid("no manifest.json")
        return {"url": url.encode()}

    named_one = str(folder / ckpt.checkpoint_name(explicit)) if explicit else None
    url, reason, files = choose_resume(str(folder), named_one, verify)
    assert (ckpt.checkpoint_step(url) if url else None) == chosen and why in reason
    assert files == ({"url": url.encode()} if url else None)


def test_an_invalid_explicit_checkpoint_with_nothing_newer_is_an_error(tmp_path) -> None:
    from ray_jobs.train.resume import choose_resume

    folder = tmp_path / "ckpts"
    for step in (10, 20):
        (folder / ckpt.checkpoint_name(step)).mkdir(parents=True)

    def verify(url):
        if ckpt.checkpoint_step(url) == 20:
            raise ckpt.CheckpointInvalid("model.safetensors: size mismatch")
        return {}

    with pytest.raises(ckpt.CheckpointInvalid, match="not valid .*size mismatch.* no valid checkpoint is newer"):
        choose_resume(str(folder), str(folder / ckpt.checkpoint_name(20)), verify)


def test_an_in_job_restart_of_a_watchdog_attempt_resumes_from_the_newest_checkpoint(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "floor")
    train(c, manifest, model, stop_at=20)
    by_step = dict(checkpoints(c))
    t = Trainer(c, manifest, model, LocalRuntime())
    t.resume_or_start(explicit_checkpoint=by_step[10])  # the watchdog named step 10; step 20 is valid too
    assert t.loop.step == 20 and t.resumed_from == by_step[20]


def test_the_finished_model_is_scored_on_the_series_eval_set_for_the_promotion_gate(setup) -> None:
    cfg, manifest, model = setup
    c = named(cfg, "scored")
    t = train(c, manifest, model)
    pinned = DatasetManifest.parse(manifest.dump(), "pin")  # another run's dataset in general; its eval split counts
    loss = t.score(pinned)
    assert loss == pytest.approx(t.evaluate(), rel=1e-6), "the same model on the same eval rows"
    written = json.loads(Path(Layout(c.storage).score(c.name)).read_text())
    assert written == {"dataset_id": manifest.dataset_id, "eval_loss": loss, "step": 30}
    assert t.score(None) is None


def test_a_named_checkpoint_a_rank_finds_corrupt_is_refused_and_the_run_steps_back_to_the_previous(setup) -> None:
    """Same size, other bytes: only the reader's sha256 can tell. The floor no longer holds for it, its manifest is
    moved aside (so neither a later start nor the watchdog picks it again), and the run resumes from step 10."""
    cfg, manifest, model = setup
    c = named(cfg, "named-corrupt")
    straight = weights_hash(train(named(cfg, "named-corrupt-straight"), manifest, model))
    train(c, manifest, model, stop_at=25)
    url = checkpoints(c)[0][1]
    target = Path(url) / "model.safetensors"
    target.write_bytes(bytes(target.stat().st_size))
    t = Trainer(c, manifest, model, LocalRuntime())
    t.resume_or_start(explicit_checkpoint=url)
    assert t.resumed_from.endswith(ckpt.checkpoint_name(10))
    assert (Path(url) / "manifest.refused.json").exists() and not (Path(url) / "manifest.json").exists()
    t.fit()
    assert weights_hash(t) == straight


def test_a_checkpoint_whose_write_failed_is_abandoned_and_taken_at_the_next_step(setup, monkeypatch, caplog) -> None:
    from ray_jobs.checkpoint import writer

    cfg, manifest, model = setup
    straight = weights_hash(train(named(cfg, "failed-write-straight"), manifest, model))
    real = writer.write_part

    def flaky(part, url):
        if part.step == 10:
            raise ConnectionError("the store refused the PUT")
        return real(part, url)

    monkeypatch.setattr(writer, "write_part", flaky)
    c = named(cfg, "failed-write")
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        t = train(c, manifest, model)
    steps = sorted(s for s, _ in checkpoints(c))
    assert 10 not in steps and 11 in steps and 30 in steps, steps
    assert "checkpoint for step 10 abandoned" in caplog.text
    assert weights_hash(t) == straight


@pytest.mark.parametrize(
    ("content", "moved"),
    [(b"", True), (b'{"checkpoints": [', True), (b"\xff\xfe", True), (b'{"checkpoints": []}', False), (None, False)],
    ids=["empty", "torn", "not-utf8", "whole", "absent"],
)
def test_a_torn_ray_train_checkpoint_record_is_moved_aside_before_the_trainer_is_built(
    tmp_path, content, moved
) -> None:
    """A head killed while Ray Train's controller rewrote its checkpoint manager snapshot left it empty, and every
    restart's TrainController died reading it (this suite's chaos run of 2026-11-27): the job's driver moves such a
    file aside before it builds the trainer; a whole one, or none, is left alone."""
    from ray_jobs.job import RAY_TRAIN_SNAPSHOT, build_trainer, worker_config

    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"storage={tmp_path}"])
    run_dir = tmp_path / "ray" / cfg.name
    run_dir.mkdir(parents=True)
    if content is not None:
        (run_dir / RAY_TRAIN_SNAPSHOT).write_bytes(content)
    build_trainer(
        cfg, worker_config(cfg, made_manifest(), AttemptInputs(manifest_url="/d/manifest.json", model_path="/m"))
    )
    assert (run_dir / f"{RAY_TRAIN_SNAPSHOT}.torn").exists() == moved
    assert (run_dir / RAY_TRAIN_SNAPSHOT).exists() == (content is not None and not moved)
