"""Base models: the built-in tiny Llama (no network) and loading any HF model/tokenizer folder or hub id.

The built-in model is a Llama-architecture causal LM built from ``model.tiny`` with seeded init, and a
character-level tokenizer trained locally with HF ``tokenizers`` on printable ASCII. Both are saved as a
normal ``save_pretrained`` folder, so everything downstream takes the same code path as a real model.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

from ray_jobs.config import BUILTIN_PREFIX, ModelConfig

# Bump when the builtin recipe changes, so a new recipe never reuses an old folder on storage.
# 2: the tokenizer adds BOS itself (a post-processor), as real tokenizers do.
_BUILTIN_RECIPE = 2
_ALPHABET = string.printable  # digits, letters, punctuation, whitespace: what the sample tasks use
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def is_builtin(model: ModelConfig) -> bool:
    return model.name_or_path.startswith(BUILTIN_PREFIX)


def builtin_name(model: ModelConfig, seed: int) -> str:
    """Folder name for a built-in model: its recipe, shape and seed, hashed."""
    spec = json.dumps(
        {"recipe": _BUILTIN_RECIPE, "name": model.name_or_path, "tiny": model.tiny.model_dump(), "seed": seed},
        sort_keys=True,
    )
    short = model.name_or_path[len(BUILTIN_PREFIX) :]
    return f"{short}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"


def train_char_tokenizer():
    """A character-level tokenizer trained on printable ASCII; unknown characters map to ``<unk>``.

    Encoding adds BOS in front (``tok(text)`` gives ``<s>`` + characters), so staging and inference both get it from
    the tokenizer, the way they do from a real model's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS.values()), min_frequency=1)
    tok.train_from_iterator([_ALPHABET], trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def builtin_config(model: ModelConfig, tokenizer=None):
    """The tiny Llama's ``LlamaConfig`` (its vocabulary: the character tokenizer's, trained here when not given)."""
    from transformers import LlamaConfig

    tokenizer = train_char_tokenizer() if tokenizer is None else tokenizer
    t = model.tiny
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_heads,
        max_position_embeddings=t.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_builtin(model: ModelConfig, seed: int, out_dir: str | Path) -> Path:
    """Build the tiny Llama and its tokenizer into ``out_dir`` (a save_pretrained folder)."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = train_char_tokenizer()
    config = builtin_config(model, tokenizer)
    torch.manual_seed(seed)
    lm = LlamaForCausalLM(config)
    out = Path(out_dir)
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Written last: its presence on storage marks a complete folder.
    (out / "README.md").write_text(
        f"# unbroken built-in {model.name_or_path}\n\nRandomly initialised (seed {seed}) Llama-architecture model "
        f"with a character-level tokenizer trained on printable ASCII.\n\n"
        f"```json\n{json.dumps(model.tiny.model_dump(), indent=2)}\n```\n"
    )
    return out


def builtin_url(cfg) -> str:
    """Where the built-in model of ``cfg`` (a Config) lives on its storage."""
    from ray_jobs.storage import Layout

    return Layout(cfg.storage).model_dir(builtin_name(cfg.model, cfg.train.seed))


def base_model_ready(cfg) -> bool:
    """Whether the base model is there to load: always for a hub id or a folder; for the built-in model, whether it
    was built on this storage already (when not, no run on this storage can have trained on it yet)."""
    from ray_jobs.storage import exists, join

    return not is_builtin(cfg.model) or exists(join(builtin_url(cfg), "README.md"))


def check_local_folder(name_or_path: str) -> None:
    """A path-like model (``/x``, ``./x``, ``~/x``, ``.unbroken/...``) must exist: otherwise transformers would take
    it for a hub id and fail with a hub error that never names the field."""
    from ray_jobs.config import ConfigError

    if "://" in name_or_path or not name_or_path.startswith(("/", ".", "~")):
        return  # a hub id (org/name) or a storage URL, checked where it is read
    if not Path(name_or_path).expanduser().is_dir():
        hint = " (run `make smollm2` to build it)" if "smollm2" in name_or_path else ""
        raise ConfigError([f"model.name_or_path: no such model folder: {name_or_path}{hint}"])


def ensure_base_model(cfg) -> tuple[str, bool]:
    """Where the job loads the base model from -- a hub id, a folder, or the built-in model on storage (built there
    first when missing) -- and whether it was built now. No Prefect: the flow's task and local mode both call it."""
    import tempfile

    from ray_jobs.storage import upload_dir

    if not is_builtin(cfg.model):
        check_local_folder(cfg.model.name_or_path)
        return cfg.model.name_or_path, False
    url = builtin_url(cfg)
    if base_model_ready(cfg):
        return url, False
    with tempfile.TemporaryDirectory(prefix="unbroken-model-") as d:
        build_builtin(cfg.model, cfg.train.seed, d)
        upload_dir(d, url)
    return url, True
