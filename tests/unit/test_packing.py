"""Packing: examples share rows but never see each other, and what is trained on a row is each example's own loss.

transformers builds a block-diagonal causal mask from position ids that restart at 0
(``masking_utils.find_packed_sequence_indices``), but only when no attention mask and no KV cache are passed, so
the model is called as the trainer calls it: ``model(input_ids, labels, position_ids, use_cache=False)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_jobs.config import DataConfig
from ray_jobs.contracts.dataset import Shard
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.pack import pack
from ray_jobs.data.reading import load_rows
from ray_jobs.data.records import parse_records
from ray_jobs.data.sources import SourceFile
from ray_jobs.data.staging import stage
from ray_jobs.data.tokenize import IGNORE_INDEX, Tokenized, chat_renderer
from ray_jobs.model.builtin import train_char_tokenizer
from tests.unit.test_tokenize import CONVERSATION

X = IGNORE_INDEX


def test_positions_restart_per_example_and_first_tokens_are_never_targets() -> None:
    rows = pack([([1, 5, 6], [X, 5, 6]), ([7, 8], [7, 8]), ([9, 9, 9, 9], [9, 9, 9, 9])], seq_len=6, pad_id=0)
    assert rows.ids == [[1, 5, 6, 7, 8, 0], [9, 9, 9, 9, 0, 0]]
    assert rows.positions == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]], "padding is a run of its own"
    assert rows.labels == [[X, 5, 6, X, 8, X], [X, 9, 9, 9, X, X]]


def forward_loss(model, ids, labels, positions) -> torch.Tensor:
    """The loss exactly as Trainer.train_step / evaluate compute it."""
    t = [torch.tensor(x, dtype=torch.long).reshape(1, -1) for x in (ids, labels, positions)]
    return model(input_ids=t[0], labels=t[1], position_ids=t[2], use_cache=False).loss


def assert_packed_loss_is_each_examples_own(model, examples: list[tuple[list[int], list[int]]], pad_id: int) -> None:
    seq_len = sum(len(ids) for ids, _ in examples) + 5
    rows = pack(examples, seq_len, pad_id)
    assert len(rows.ids) == 1, "one row holding every example"
    with torch.no_grad():
        packed = forward_loss(model, rows.ids[0], rows.labels[0], rows.positions[0]).item()
        alone = [(forward_loss(model, ids, labels, range(len(ids))).item(), labels) for ids, labels in examples]
    counts = [sum(1 for x in labels[1:] if x != IGNORE_INDEX) for _, labels in alone]
    expected = sum(loss * n for (loss, _), n in zip(alone, counts, strict=True)) / sum(counts)
    assert packed == pytest.approx(expected, abs=1e-5)
    shuffled = pack(examples[::-1], seq_len, pad_id)  # the same examples in another order: the same loss
    with torch.no_grad():
        assert forward_loss(model, shuffled.ids[0], shuffled.labels[0], shuffled.positions[0]).item() == pytest.approx(
            expected, abs=1e-5
        )


def staged_examples(tok, objs: list[dict], **cfg) -> list[tuple[list[int], list[int]]]:
    data = DataConfig(train="mem.jsonl", seq_len=512, **cfg)
    src = SourceFile("mem.jsonl", b"".join(json.dumps(o).encode() + b"\n" for o in objs))
    render = chat_renderer(tok, "t") if data.format == "chat" else None
    records, rejects = parse_records(src, data, render=render)
    assert not rejects
    return Tokenized(tok, records, data.seq_len).examples


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_builtin_model_packed_loss_equals_each_examples_own(attn: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attn_implementation=attn)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    pairs = [{"input": f"{i}+{i * 7}=", "target": str(i * 8)} for i in (3, 41, 12)]
    assert_packed_loss_is_each_examples_own(model, staged_examples(tok, pairs), tok.pad_token_id)


@pytest.fixture(scope="module")
def smol(smollm2: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2), AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_smollm2_packed_loss_equals_each_examples_own(smol, attn: str) -> None:
    tok, model = smol
    model.set_attn_implementation(attn)
    chats = [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "Capital of France?"},
                                                        {"role": "assistant", "content": "Paris."}]}]  # fmt: skip
    examples = staged_examples(tok, chats, format="chat")
    examples += staged_examples(tok, [{"input": "Say hi:", "target": " hi"}])
    assert_packed_loss_is_each_examples_own(model.eval(), examples, tok.pad_token_id)


def test_load_rows_returns_staged_positions_and_counts_old_shards_from_zero(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"input": f"{i}+1=", "target": str(i + 1)}) + "\n" for i in range(40)))
    storage = str(tmp_path / "s")
    r = stage(DataConfig(train=str(src), seq_len=32, min_shards=1), train_char_tokenizer(), "b", storage)
    cache = ShardCache(storage, r.dataset_id, str(tmp_path / "cache"))
    ids, labels, positions = load_rows(cache, r.manifest.shards["train"], 32)
    table = pq.read_table(tmp_path / "s" / "datasets" / r.dataset_id / "train-00000.parquet")
    assert positions.tolist() == table.column("position_ids").to_pylist() and positions.dtype == np.int64
    assert ids.shape == labels.shape == positions.shape

    old = tmp_path / "old.parquet"  # staging version 1 wrote no position_ids
    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4]] * 2, "labels": [[X, 2, 3, 4]] * 2}), old)
    entry = Shard(file="old.parquet", bytes=old.stat().st_size, rows=2, sha256="0" * 64)
    cache.local_path = lambda e: old  # the cache is not what is tested here
    assert load_rows(cache, [entry], 4)[2].tolist() == [[0, 1, 2, 3]] * 2
