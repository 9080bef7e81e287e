"""A reward model (TRL's RewardTrainer) trains on the rows preference records stage (``data.format: preference``):
the rows give it exactly what its own tokenization and collator build, and it starts from a causal LM's folder (the
built-in tiny Llama) as a sequence classifier with a new one-output head."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ray_jobs.data.preference import reward_batch
from tests.unit.test_preference import conversational, plain
from tests.unit.test_unpaired import EOS_TEMPLATE, assert_same, staged_rows, tiny_model

BATCH = 8


def reward_trainer(model: str, tok, records: list[dict], out: Path):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=BATCH, use_cpu=True, report_to="none",
                        save_strategy="no")  # fmt: skip
    return RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)


@pytest.mark.parametrize("make", [plain, conversational], ids=["plain", "conversational"])
def test_preference_rows_give_trl_the_reward_batches_it_builds(tmp_path: Path, make) -> None:
    from transformers import LlamaForSequenceClassification

    model, tok = tiny_model(tmp_path / "model", EOS_TEMPLATE)
    records = [make(i) for i in range(3 * BATCH + 3)]
    (ids, labels, coded), m = staged_rows(tmp_path, records, tok)
    assert m.format == "preference" and m.counts.train_rows == len(records)
    trainer = reward_trainer(model, tok, records, tmp_path / "rm")
    assert isinstance(trainer.model, LlamaForSequenceClassification) and trainer.model.config.num_labels == 1
    pad = m.tokenizer.pad_token_id
    for k in range(0, len(records), BATCH):
        examples = [trainer.train_dataset[i] for i in range(k, min(k + BATCH, len(records)))]
        assert_same(reward_batch(ids[k : k + BATCH], labels[k : k + BATCH], coded[k : k + BATCH], pad),
                    trainer.data_collator(examples))  # fmt: skip
    keep = np.arange(BATCH) % 2 == 0  # pairs past train.epochs' last pass: the chosen sequence on both sides
    past = reward_batch(ids[:BATCH], labels[:BATCH], coded[:BATCH], pad, keep=keep)
    whole = reward_batch(ids[:BATCH], labels[:BATCH], coded[:BATCH], pad)
    both = np.concatenate([np.ones(BATCH, dtype=bool), keep])
    for key in ("input_ids", "attention_mask"):
        assert past[key][both].tolist() == whole[key][both].tolist(), key
        assert past[key][BATCH:][~keep].tolist() == past[key][:BATCH][~keep].tolist(), key
    assert_dropped_pairs_move_nothing(trainer, reward_batch(ids[:BATCH], labels[:BATCH], coded[:BATCH], pad,
                                                            keep=np.zeros(BATCH, dtype=bool)))  # fmt: skip


def assert_dropped_pairs_move_nothing(trainer, batch: dict) -> None:
    """A batch of pairs none of which is kept: RewardTrainer's loss is log 2, and its gradient (next to) none."""
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    assert max(float(p.grad.abs().max()) for p in trainer.model.parameters() if p.grad is not None) < 1e-6


def test_both_sequences_end_at_the_answers_end_of_turn_marker_whatever_the_template_writes_after_it(tmp_path) -> None:
    from ray_jobs.model.builtin import train_char_tokenizer

    tok = train_char_tokenizer()
    tok.chat_template = EOS_TEMPLATE.replace("</s>{% endfor %}", "</s>\n{% endfor %}")  # ChatML's newline after it
    (ids, labels, coded), m = staged_rows(tmp_path, [conversational(i) for i in range(10)], tok)
    batch = reward_batch(ids, labels, coded, m.tokenizer.pad_token_id)
    last = batch["attention_mask"].sum(1) - 1
    assert (batch["input_ids"].gather(1, last[:, None]) == tok.eos_token_id).all(), "each score read at its EOS"
