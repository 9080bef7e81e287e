"""QLoRA (``model.quantization: 4bit``): the base loaded in 4-bit NF4 by bitsandbytes (on this CPU), LoRA adapters
trained on it in fp32, by the native loop and by HF's Trainer. It learns; a run stopped after a checkpoint resumes
bit-identical (the checkpoint holds the adapters alone; the base is quantized again, the same way); the export is the
base unquantized with the trained adapters merged in (or the adapters alone). What cannot run is refused by name when
the config loads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ray_jobs import checkpoint as ckpt
from ray_jobs.config import Config, ConfigError, load_config
from ray_jobs.model.loading import load_model
from ray_jobs.storage import Layout
from ray_jobs.train.trainer import Trainer
from tests.conftest import ROOT, tiny_overrides
from tests.unit.test_hf_engine import named, train
from tests.unit.test_trainer import staged_builtin, weights_hash

DEMO = ROOT / "configs" / "demo.yaml"
QLORA = ["model.quantization=4bit", "model.lora.r=4", "model.lora.target_modules=all-linear"]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["model.quantization=4bit"], "model.quantization: 4bit keeps the base model frozen in 4-bit: only LoRA"),
        (
            [*QLORA, "fault_tolerance.live_recovery=true", "cluster.num_workers=2"],
            "model.quantization: 4bit is not supported with fault_tolerance.live_recovery",
        ),  # fmt: skip
        (["model.quantization=8bit"], "model.quantization: Input should be 'none' or '4bit'"),
    ],
)
def test_what_a_4bit_base_cannot_take_is_refused_by_name_when_the_config_loads(overrides, says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert says in str(e.value)


def test_without_bitsandbytes_a_local_head_is_refused_and_a_remote_clusters_workers_say_so(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"model.quantization: 4bit needs the bitsandbytes package: .*\[qlora\]"):
        load_config(DEMO, QLORA)
    assert load_config(DEMO, [*QLORA, "cluster.address=http://10.0.0.7:8265"]).model.quantization == "4bit"


def test_a_worker_of_a_run_without_quantization_never_imports_bitsandbytes() -> None:
    """A process of a 4-bit run keeps it; one of a run without quantization sees it absent, as peft and TRL then do
    (they import it whenever it is installed), and trains LoRA all the same. A process of its own: it cannot import
    bitsandbytes afterwards."""
    script = """
import importlib.util, sys
from ray_jobs.model.loading import forgo_bitsandbytes
assert not forgo_bitsandbytes("4bit") and "bitsandbytes" not in sys.modules
assert forgo_bitsandbytes("none") and importlib.util.find_spec("bitsandbytes") is None
import peft, peft.helpers, trl
from transformers import LlamaConfig, LlamaForCausalLM
assert peft.helpers.bnb is None and "bitsandbytes" not in {m.split(".")[0] for m in sys.modules if sys.modules[m]}
tiny = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=32))
lora = peft.get_peft_model(tiny, peft.LoraConfig(r=2, target_modules=["q_proj"]))
assert lora.get_nb_trainable_parameters()[0] > 0
try:
    import bitsandbytes
except ImportError:
    print("hidden")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "hidden", r.stderr[-3000:]
    assert "kernels-community" not in r.stderr  # bitsandbytes' CPU warning: never loaded


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Config, dict, str]:
    storage = tmp_path_factory.mktemp("qlora") / "storage"
    # (hidden 128: bitsandbytes' CPU kernel needs a layer's input wider than the test default's 32)
    extra = {"train.lr": 0.01, "train.warmup_steps": 3, "train.max_steps": 20, "train.log_every_steps": 1,
             "model.tiny.hidden_size": 128, "model.tiny.intermediate_size": 256}  # fmt: skip
    cfg = load_config(DEMO, [*tiny_overrides(storage, **extra), *QLORA])
    return cfg, *staged_builtin(cfg)


@pytest.fixture(scope="module", params=["native", "hf"])
def runs(setup, request) -> tuple[Config, Trainer, Trainer, str]:
    """Per engine: 20 steps straight, and a run stopped at step 15 (its checkpoint at 10) then resumed."""
    cfg, manifest, model = setup
    straight = train(named(cfg, f"{request.param}-straight", request.param), manifest, model)
    cut = named(cfg, f"{request.param}-cut", request.param)
    train(cut, manifest, model, stop_at=15)
    return cut, straight, train(cut, manifest, model), model


def test_a_4bit_base_trains_fp32_adapters_learns_and_resumes_bit_identical(runs) -> None:
    import bitsandbytes as bnb

    cut, straight, resumed, _ = runs
    base = resumed.model.module if hasattr(resumed.model, "module") else resumed.model
    linears = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears and all(m.weight.dtype == torch.uint8 for m in linears), "the base's linear layers are 4-bit"
    trained = {n: p for n, p in base.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and p.dtype == torch.float32 for n, p in trained.items())
    assert resumed.resumed_from.endswith("checkpoint-step-00000010")
    assert weights_hash(resumed) == weights_hash(straight), "the base quantized again the same way, the adapters exact"
    rows = [json.loads(ln) for ln in Path(Layout(cut.storage).metrics(cut.name)).read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0], f"it learns: {evals}"
    stored, _, _ = ckpt.decode(
        ckpt.read_verified(ckpt.list_checkpoints(Layout(cut.storage).checkpoints_dir(cut.name))[0][1])
    )
    assert stored and all("lora_" in k for k in stored), "a checkpoint holds the adapters, never the 4-bit base"


def test_the_export_is_the_base_unquantized_with_the_adapters_merged_or_the_adapters_alone(runs) -> None:
    cut, _, resumed, model = runs
    final = Path(resumed.export_final())
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config, "a plain model: the base unquantized"
    exported = load_model(str(final), dtype=torch.float32)
    assert not any("4bit" in type(m).__name__ for m in exported.modules())
    base = load_model(model, dtype=torch.float32)
    adapters = {k: v for k, v in ckpt.model_state(resumed.model, False, True).items()}
    a = next(v for k, v in adapters.items() if k.endswith("layers.0.self_attn.q_proj.lora_A.default.weight"))
    b = next(v for k, v in adapters.items() if k.endswith("layers.0.self_attn.q_proj.lora_B.default.weight"))
    scale = cut.model.lora.alpha / cut.model.lora.r
    merged = exported.model.layers[0].self_attn.q_proj.weight - base.model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(merged, scale * (b @ a), atol=1e-6), "the full-precision base plus the trained adapters"
    resumed.cfg.train.export = "adapter"
    adapter = Path(resumed.export_final())
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    assert torch.equal(load_model(str(adapter), dtype=torch.float32).model.layers[0].self_attn.q_proj.weight,
                       exported.model.layers[0].self_attn.q_proj.weight)  # fmt: skip
