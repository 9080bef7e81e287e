"""LoRA options: all-linear, modules_to_save, LoRA on a model with tied embeddings (SmolLM2-135M), and a LoRA config
that does not fit the model failing with the field named, in the flow before any cluster work and in the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_jobs.checkpoint import unwrap
from ray_jobs.config import ConfigError, LoraConfig, ModelConfig, load_config
from ray_jobs.model.builtin import build_builtin
from ray_jobs.model.loading import config_dict, load_model_fp32, meta_model
from ray_jobs.model.lora import all_linear_targets, lora_problems
from ray_jobs.train.model import apply_lora, build_model
from ray_jobs.train.runtime import LocalRuntime
from tasks.model import check_model_options
from tests.conftest import ROOT, tiny_overrides
from tests.unit.smollm2_runs import export_tensors, load_and_generate, newest_checkpoint, real_config, staged, tied
from tests.unit.test_trainer import named, train, weights_hash

SMOLLM2_LINEARS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


@pytest.fixture(scope="module")
def real(tmp_path_factory, smollm2) -> tuple[Path, dict, str]:
    root = tmp_path_factory.mktemp("lora") / "storage"
    cfg = real_config(root, str(smollm2))
    return root, staged(cfg, str(smollm2)), str(smollm2)


def lora_run(real, name: str, **lora: object):
    """A straight 3-step LoRA run and one stopped at step 2 and resumed, on SmolLM2 (fp32)."""
    root, manifest, model = real
    cfg = real_config(root, model, name=name, **{f"model.lora.{k}": v for k, v in {"r": 4, **lora}.items()})
    straight = train(named(cfg, f"{name}-straight", checkpoint__every_steps=0), manifest, model)
    train(cfg, manifest, model, stop_at=2)
    return cfg, straight, train(cfg, manifest, model)


# -- LoRA on the tied-embedding SmolLM2 -----------------------------------------------------------------------
@pytest.mark.full(shard=1)  # a real-model run
def test_default_lora_on_tied_smollm2_resumes_exactly_and_exports_it_still_tied(real, smollm2) -> None:
    cfg, straight, resumed = lora_run(real, "lora-default")
    assert weights_hash(resumed) == weights_hash(straight)
    trainable = {n for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(newest_checkpoint(cfg)[0]) == trainable, "a LoRA checkpoint holds the adapters only"
    base = resumed.model.get_base_model()
    assert tied(base), "adapters on q/v leave the tied embedding itself alone"
    adapter = _adapter_export(straight, smollm2)  # before the merged export below merges resumed's model in place

    final = Path(resumed.export_final())
    assert json.loads((final / "config.json").read_text())["tie_word_embeddings"] is True
    assert not any("lora" in k for k in export_tensors(final))
    lm, text = load_and_generate(final)
    assert tied(lm) and text.startswith("12+3=")
    original = load_model_fp32(str(smollm2))
    assert torch.equal(lm.lm_head.weight, original.lm_head.weight), "adapters on q/v leave the embedding alone"
    assert not torch.equal(lm.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():  # the adapter on the base answers as the merged export does (both saved as bf16)
        assert torch.allclose(adapter(ids).logits, lm.float()(ids).logits, atol=0.05)


def _adapter_export(trainer, smollm2):
    """``train.export: adapter`` of a trained LoRA run: the PEFT folder alone (adapters, no base weights), naming
    the base model; unbroken's loader (a report's, a warm start's) opens it as the base with the adapters merged."""
    trainer.cfg = named(trainer.cfg, "lora-adapter", train__export="adapter")
    final = Path(trainer.export_final())
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert not list(final.glob("model*.safetensors")), "no base weights in an adapter export"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(smollm2)
    keys = export_tensors(final)  # adapter_model.safetensors: the only weights file
    assert keys and all("lora_" in k for k in keys), keys
    assert "LoRA r=4, adapter" in (final / "README.md").read_text()
    assert config_dict(str(final))["tie_word_embeddings"] is True, "an adapter folder's config is its base's"
    return load_model_fp32(str(final)).eval()


@pytest.mark.full(shard=1)  # a real-model run
def test_modules_to_save_lm_head_on_a_tied_model_trains_the_one_shared_matrix(real, smollm2) -> None:
    cfg, straight, resumed = lora_run(real, "lora-head", modules_to_save="[lm_head]")
    assert cfg.model.lora.modules_to_save == ["lm_head"], "peft edits the list it is given; the config must not change"
    assert weights_hash(resumed) == weights_hash(straight)
    base = resumed.model.get_base_model()
    head, embed = base.lm_head.modules_to_save["default"], base.model.embed_tokens.modules_to_save["default"]
    assert head.weight is embed.weight and head.weight.requires_grad, "peft ties the trained copies"
    full = [n for n, p in resumed.model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert full == ["base_model.model.model.embed_tokens.modules_to_save.default.weight"]
    assert set(newest_checkpoint(cfg)[0]) == {n for n, p in resumed.model.named_parameters() if p.requires_grad}

    final = Path(resumed.export_final())
    assert json.loads((final / "config.json").read_text())["tie_word_embeddings"] is True
    lm, _ = load_and_generate(final)
    assert tied(lm) and torch.equal(lm.lm_head.weight, embed.weight.detach())
    assert not torch.equal(lm.lm_head.weight, load_model_fp32(str(smollm2)).lm_head.weight), "the head was trained"


def test_all_linear_adapts_every_linear_layer_but_the_output_head(smollm2) -> None:
    cfg = real_config(Path("/tmp/unused"), str(smollm2), **{"model.lora.target_modules": "all-linear"})
    peft_model = apply_lora(load_model_fp32(str(smollm2)), cfg)
    adapted = {n.removeprefix("base_model.model.") for n in peft_model.base_model.targeted_module_names}
    assert adapted == set(all_linear_targets(meta_model(str(smollm2))))
    assert len(adapted) == 30 * 7 and "lm_head" not in adapted


# -- a LoRA config that does not fit the model ----------------------------------------------------------------
def test_a_missing_target_names_the_field_the_model_and_its_linear_layers(smollm2) -> None:
    problems = lora_problems(meta_model(str(smollm2)), LoraConfig(target_modules=["q_proj", "c_attn"]), "smol")
    assert problems == [
        f"model.lora.target_modules: c_attn not found in smol (LlamaForCausalLM); its linear layers are: "
        f"{SMOLLM2_LINEARS}"
    ]


def test_an_adapter_on_a_tied_embedding_is_refused_since_peft_would_merge_it_twice(smollm2, tmp_path) -> None:
    (problem,) = lora_problems(meta_model(str(smollm2)), LoraConfig(target_modules=["q_proj", "lm_head"]), "smol")
    assert problem.startswith("model.lora.target_modules: lm_head shares its weight with the tied input/output")
    assert "model.lora.modules_to_save: [lm_head]" in problem
    build_builtin(ModelConfig(), 0, tmp_path / "untied")
    assert lora_problems(meta_model(str(tmp_path / "untied")), LoraConfig(target_modules=["lm_head"]), "tiny") == []


def test_a_missing_module_to_save_names_the_field(smollm2) -> None:
    (problem,) = lora_problems(meta_model(str(smollm2)), LoraConfig(modules_to_save=["score"]), "smol")
    assert problem.startswith("model.lora.modules_to_save: score not found in smol (LlamaForCausalLM)")
    assert "embed_tokens" in problem and "lm_head" in problem


def test_all_linear_on_a_model_whose_only_linear_layer_is_its_head_names_the_field() -> None:
    """No HF causal LM lacks linear layers, so this is a hand-built module tree (embedding, norm, tied head)."""

    class HeadOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.norm = torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    (problem,) = lora_problems(HeadOnly(), LoraConfig(target_modules="all-linear"), "head-only")
    assert problem.startswith("model.lora.target_modules: all-linear found no linear layers in head-only (HeadOnly)")


def test_the_flow_check_lists_every_lora_problem_without_loading_weights(tmp_path, smollm2, monkeypatch) -> None:
    import transformers

    def no_weights(*a, **k):
        raise AssertionError("the check must not load weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    bad = ["model.lora.target_modules=[q_proj, qkv]", "model.lora.modules_to_save=[score]"]
    cfg = load_config(
        ROOT / "configs" / "demo.yaml", [*tiny_overrides(tmp_path), f"model.name_or_path={smollm2}", *bad]
    )
    with pytest.raises(ConfigError) as e:
        check_model_options.fn(cfg, str(smollm2))
    msg = str(e.value)
    assert msg.startswith("invalid config (2 problem(s)):")
    assert "model.lora.target_modules: qkv not found" in msg and "model.lora.modules_to_save: score not found" in msg
    check_model_options.fn(load_config(ROOT / "configs" / "demo.yaml", tiny_overrides(tmp_path)), str(smollm2))


def test_the_job_refuses_a_target_the_model_lacks_with_a_value_error_naming_the_field(tmp_path) -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", [*tiny_overrides(tmp_path), "model.lora.target_modules=[c_attn]"])
    build_builtin(cfg.model, cfg.train.seed, tmp_path / "base")
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: c_attn not found .* q_proj, k_proj"):
        build_model(cfg, str(tmp_path / "base"), LocalRuntime())


def test_the_tiny_model_with_all_linear_and_modules_to_save_trains(tmp_path) -> None:
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [*tiny_overrides(tmp_path), "model.lora.target_modules=all-linear", "model.lora.modules_to_save=[lm_head]"],
    )
    build_builtin(cfg.model, cfg.train.seed, tmp_path / "base")
    model = unwrap(build_model(cfg, str(tmp_path / "base"), LocalRuntime()))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.lm_head.modules_to_save.default.weight" in trainable, "untied head: trained as itself"
    assert any("mlp.down_proj.lora_A" in n for n in trainable)


def test_a_missing_local_model_folder_is_a_config_error_naming_the_field(tmp_path) -> None:
    from ray_jobs.config import ConfigError
    from ray_jobs.model.builtin import check_local_folder

    with pytest.raises(
        ConfigError, match=r"model.name_or_path: no such model folder: \./nope/smollm2 \(run `make smollm2`"
    ):
        check_local_folder("./nope/smollm2")
    check_local_folder(str(tmp_path))  # an existing folder
    check_local_folder("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id: not checked here
    check_local_folder("s3://bucket/models/base")  # a storage URL: read where it is used
