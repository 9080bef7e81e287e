"""A newcomer's mistakes, each tried through the command line as they would make it: one clear message naming the
field, file:line or URL and what to do, exit 2, no traceback (unbroken/errors.py; the checks are control/check/).
Every case here is refused before Prefect, staging or a cluster is touched; the mistakes only a flow can find (a bad
record past the first, a cluster too small) are tests/integration/test_finetune_flow.py and
test_existing_cluster.py, which assert the same: exit 2, the message once, no traceback."""

from __future__ import annotations

import logging
import subprocess

import pytest

from control.check.plan import GB, ModelShape, plan
from control.check.plan import memory as plan_memory
from ray_jobs.errors import UserError
from ray_jobs.secrets import MaskedError
from tests.conftest import ROOT
from tests.s3 import moto_server
from unbroken import errors
from unbroken.cli import main

DEMO = str(ROOT / "configs" / "demo.yaml")
TUNE = str(ROOT / "configs" / "demo-tune.yaml")
PORTS = ["--set", "cluster.dashboard_port=8597", "--set", "cluster.head_port=6597"]  # nothing answers there


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """What the mistakes point at: a record missing its target, a folder nobody may write to (immutable: root too),
    an S3 endpoint without the bucket."""
    root = tmp_path_factory.mktemp("mistakes")
    (root / "bad.jsonl").write_text('{"input": "1+1="}\n{"input": "2+2=", "target": "4"}\n')
    (root / "mixed.jsonl").write_text('{"input": "1+1=", "target": "2"}\n{"text": "a document"}\n')
    locked = root / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here: no folder root cannot write to")
    with moto_server():
        yield root
    subprocess.run(["chattr", "-i", str(locked)], check=True)


def mistakes(root) -> list[tuple[str, list[str], dict[str, str], str]]:
    """(mistake, argv, environment, what the message must say)."""
    run = ["run", DEMO, "--set", f"storage={root / 'storage'}", *PORTS]
    return [
        ("bad field", [*run, "--set", "train.max_steps=-1"], {}, "train.max_steps: Input should be greater than"),
        ("unknown field", [*run, "--set", "train.max_stepz=5"], {}, "train.max_stepz: unknown key"),
        ("bad file:line", [*run, "--set", f"data.train={root / 'bad.jsonl'}"], {},
         f"{root / 'bad.jsonl'}:1: missing field 'target'"),  # every record of small data read before Prefect
        ("records of two shapes", [*run, "--set", f"data.train={root / 'mixed.jsonl'}", "--set", "data.format=auto"], {},
         f"data.format=auto: the records of {root / 'mixed.jsonl'} disagree on their shape: line 1 is pairs, line 2"),
        ("missing file", [*run, "--set", "data.train=/no/such/train.jsonl"], {},
         "data.train: no such file or folder: /no/such/train.jsonl"),
        ("missing config file", ["run", str(root / "nope.yaml")], {}, "nope.yaml"),
        ("unknown model", [*run, "--set", "model.name_or_path=./no-such-model"], {},
         "model.name_or_path: no such model folder: ./no-such-model"),
        ("offline hub id", [*run, "--set", "model.name_or_path=Qwen/Qwen2.5-0.5B"], {"offline": "1"},
         "model.name_or_path: cannot read Qwen/Qwen2.5-0.5B's config.json"),
        ("bad LoRA target", [*run, "--set", "model.lora.target_modules=[nope_proj]"], {},
         "model.lora.target_modules: nope_proj not found in builtin:tiny-llama"),
        ("GPU asked with none", [*run, "--set", "cluster.use_gpu=true"], {"CUDA_VISIBLE_DEVICES": ""},
         "cluster.use_gpu with cluster.num_workers=2 needs 2 GPUs; the cluster has 0; set cluster.use_gpu=false, or "
         "cluster.address to a cluster with GPUs"),
        ("unreachable cluster address", [*run, "--set", "cluster.address=http://127.0.0.1:9"], {},
         "cluster.address http://127.0.0.1:9 is not reachable: [Errno 111] Connection refused"),
        ("S3 bucket missing", [*run, "--set", "storage=s3://no-such-bucket/unbroken"], {},
         "storage: cannot write to s3://no-such-bucket/unbroken: FileNotFoundError"),
        ("no write permission", [*run, "--set", f"storage={root / 'locked' / 'storage'}"], {},
         f"storage: cannot write to {root / 'locked' / 'storage'}: PermissionError"),
        ("bad event URI", ["serve", "--config", DEMO, "--watch-source", "/etc"], {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
         "dataset URI '/etc' is not under data.allowed_sources"),
        ("wrong command for a config", ["tune", DEMO, *PORTS], {}, "tune: the config has no tune section"),
        ("wrong command, the other way", ["run", TUNE, *PORTS], {}, "run it with `unbroken tune`"),
        ("a run that is not there", ["status", "nope", "--storage", str(root / "storage")], {}, "no run 'nope' under"),
    ]  # fmt: skip


def test_every_mistake_is_one_clear_message_and_exit_2(places, capfd, monkeypatch) -> None:
    import huggingface_hub.constants

    seen = []
    monkeypatch.setattr(errors, "hide_user_errors", lambda: None)  # Prefect's console handler is tested below
    for name, argv, env, says in mistakes(places):
        with monkeypatch.context() as m:
            for k, v in env.items():
                if k == "offline":  # read by huggingface_hub at import: its switch, as HF_HUB_OFFLINE=1 sets it
                    m.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
                else:
                    m.setenv(k, v)
            code = main(argv)
        out, err = capfd.readouterr()
        lines = (out + err).strip().splitlines()
        seen.append(name)
        assert code == 2, (name, out, err)
        assert err.startswith("error: ") and says in err, (name, err)
        assert 1 <= len(lines) <= 3 and "Traceback" not in err, (name, lines)
    assert len(seen) >= 12


def test_check_prints_the_plan_of_the_demo_and_exits_0(capfd, tmp_path) -> None:
    assert main(["check", DEMO, "--set", f"storage={tmp_path}", *PORTS]) == 0
    out = capfd.readouterr().out
    for area in ("model", "data", "cluster", "storage", "plan"):
        assert f"ok      {area}" in out, out
    assert "global batch 32 (2,048 tokens a step at seq_len 64); 2,500 steps" in out, out
    assert "memory per worker, estimated:" in out and out.rstrip().endswith("no problem found"), out


def test_an_8b_model_on_24gb_workers_does_not_fit_and_check_says_why(capfd, tmp_path) -> None:
    """Only the model's config.json is needed: its module tree is built on the meta device."""
    (tmp_path / "llama8b").mkdir()
    (tmp_path / "llama8b" / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, '
        '"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": false}'
    )
    sets = [
        f"storage={tmp_path / 's'}",
        f"model.name_or_path={tmp_path / 'llama8b'}",
        "data.seq_len=2048",
        "train.micro_batch_size=1",
    ]
    code = main(["check", DEMO, *[a for s in sets for a in ("--set", s)], *PORTS, "--worker-memory", "24GB"])
    out, err = capfd.readouterr()
    assert code == 2 and "8.03 B parameters, 8.03 B trained" in out, out
    (refusal,) = [ln for ln in out.splitlines() if ln.startswith("PROBLEM plan")]
    assert "does not fit" in refusal and "24.0 GB available (as given)" in refusal, refusal
    assert "the largest part is optimizer (59.8 GB)" in refusal and "model.lora" in refusal, refusal
    assert "1 problem(s): this run would not start" in err, err


class Wrapped(Exception):
    pass


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize(
    ("exc", "debug", "code", "traceback"),
    [
        (_raised(UserError("data.train: no such file")), False, 2, False),
        (_raised(UserError("data.train: no such file")), True, 2, True),  # --debug shows it
        (_raised(Wrapped("a library's wrapper"), UserError("model: ...")), False, 2, False),  # raised from one
        (_raised(MaskedError("the job failed: ...")), False, 1, False),  # unbroken's own failure: its message
        (_raised(KeyError("a bug")), False, 1, True),  # a bug shows where it is
        (_raised(KeyboardInterrupt()), False, 130, False),
    ],
)
def test_how_a_command_ends_on_each_kind_of_exception(exc, debug, code, traceback, capsys) -> None:
    assert errors.report(exc, debug) == code
    err = capsys.readouterr().err
    assert ("Traceback" in err) == traceback, err
    if code == 2:
        assert err.splitlines()[-1] == f"error: {errors.user_error(exc)}", err


def _record(msg: str, exc: BaseException | None = None, level: int = logging.ERROR) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("prefect.task_runs", level, __file__, 1, msg, (), info)


def test_prefects_records_of_a_user_error_stay_off_the_terminal_and_others_stay() -> None:
    mistake = UserError("1 of 2 records rejected (50.0%), over data.max_reject_fraction=0.0:\n  bad.jsonl:2: missing")
    f = errors._UserErrorRecords()
    kept = [
        f.filter(_record("Task run failed with exception: StagingError(...)", mistake)),
        f.filter(_record(f"Finished in state Failed('Task run encountered an exception StagingError: {mistake!s}')")),
        f.filter(_record(f"Finished in state Failed('Flow run encountered an exception: {mistake!s}')", level=20)),
        f.filter(_record("Finished in state Failed('RuntimeError: a bug')")),  # not the user's: kept
        f.filter(_record("staging: 50% (1 of 2 records)", level=logging.INFO)),
        f.filter(_record("Encountered exception during execution: KeyError('x')", _raised(KeyError("x")))),
    ]
    assert kept == [False, False, False, True, True, True]


SHAPE = ModelShape(params=1_000_000_000, trainable=1_000_000_000, hidden=2048, layers=16, vocab=32_000)
DPO = ["train.engine=hf", "data.format=preference", "data.too_long=reject"]
GRPO = ["train.engine=hf", "train.method=grpo", "train.rewards=[{function: configs.rewards.addition:correct}]",
        "train.hf_args={num_generations: 4, max_completion_length: 8}"]  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "gpu", "trainable", "expected"),
    [
        # fp32 master weights, gradients and AdamW's two moments: 4 + 4 + 8 bytes a parameter; fp32 activations on CPU
        (
            [],
            False,
            None,
            {
                "weights": 4e9,
                "gradients": 4e9,
                "optimizer": 8e9,
                "activations": 16 * 64 * 2048 * 4 * 17 * 16,
                "logits": 16 * 64 * 32_000 * 8,
            },
        ),
        # bf16 activations on a GPU; activation checkpointing keeps one input a layer plus one layer's whole
        (["train.gradient_checkpointing=true"], True, None, {"activations": 16 * 64 * 2048 * 2 * (16 + 16)}),
        # FSDP shards weights, gradients and moments over the (2) workers
        (["train.parallelism=fsdp"], False, None, {"weights": 2e9, "gradients": 2e9, "optimizer": 4e9}),
        # LoRA: the frozen base in fp32, only the adapters have gradients and moments
        ([], False, 10_000_000, {"weights": 4e9, "gradients": 4e7, "optimizer": 8e7}),
        # QLoRA: the frozen base at 4.5 bits a parameter
        (["model.quantization=4bit", "model.lora.r=8"], True, 10_000_000, {"weights": 990_000_000 * 0.5625 + 4e7}),
        # Liger's fused cross-entropy never materialises the logits
        (
            [
                "train.engine=hf",
                "train.hf_args={use_liger_kernel: true}",
                "cluster.use_gpu=true",
                "cluster.address=http://head:8265",
            ],
            True,
            None,
            {"logits": 0.0},
        ),
        # DPO: a pair is two sequences; its reference a frozen fp32 copy of the weights (none under LoRA)
        (
            DPO,
            False,
            None,
            {"activations": 32 * 64 * 2048 * 4 * 17 * 16, "logits": 32 * 64 * 32_000 * 8, "reference": 4e9},
        ),
        (DPO + ["train.parallelism=fsdp"], False, None, {"reference": 2e9}),
        (DPO + ["model.lora.r=8"], False, 10_000_000, {"weights": 4e9}),
        # a reward model: pairs through a one-output head
        (DPO + ["train.method=reward"], False, None, {"logits": 32 * 64 * 1 * 8}),
        (["train.engine=hf", "train.method=kto", "data.format=unpaired_preference"], False, None, {"reference": 4e9}),
        # GRPO: 4 completions a prompt (64 + 8 tokens) trained at once, and sampled at once: their KV cache and logits
        (
            GRPO,
            False,
            None,
            {"activations": 64 * 72 * 2048 * 4 * 17 * 16, "generation": 64 * 72 * 16 * 2 * 2048 * 4 + 64 * 32_000 * 4},
        ),
        (
            GRPO + ["train.hf_args={num_generations: 4, max_completion_length: 8, beta: 0.04}"],
            False,
            None,
            {"reference": 4e9},
        ),
    ],
)
def test_the_plan_estimates_each_part_of_a_worker_s_memory(sets, gpu, trainable, expected) -> None:
    from dataclasses import replace

    from ray_jobs.config import load_config

    cfg = load_config(DEMO, sets)
    shape = SHAPE if trainable is None else replace(SHAPE, trainable=trainable)
    got = plan_memory(cfg, shape, gpu)
    assert {k: got.get(k) for k in expected} == pytest.approx(expected)
    assert "reference" in got or "reference" not in expected


def test_a_plan_that_does_not_fit_names_its_largest_part_and_what_lowers_it() -> None:
    from ray_jobs.config import load_config

    p = plan(load_config(DEMO, []), SHAPE, False, 8 * GB, "as given")
    assert p.fits is False and p.total == pytest.approx(sum(p.memory.values()))
    assert "the largest part is optimizer" in p.problem() and "train.parallelism: fsdp" in p.problem()
    assert plan(load_config(DEMO, []), SHAPE, False, None, "").problem() is None  # nothing known: no verdict
