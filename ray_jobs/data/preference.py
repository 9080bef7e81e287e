"""Preference records (``data.format: preference``): a prompt with a chosen and a rejected answer, staged one record
per row in the row layout every other shape uses (``[3, seq_len]`` int32), so the node cache, the resumable cursor,
the row trace and the checkpoints serve DPO unchanged:

- row 0: prompt + chosen answer token ids, padded with the pad id;
- row 1: its labels: the chosen answer's tokens (EOS included), IGNORE_INDEX on the prompt and the padding;
- row 2: prompt + rejected answer, each token coded: its id for an answer token, ``-(id + 2)`` for a prompt token,
  ``-1`` for padding (the pad id may be EOS, which ends an answer: a code cannot be mistaken for it).

:func:`pair_batch` turns rows into what TRL's ``DPOTrainer`` computes its loss on (its ``DataCollatorForPreference``'s
``input_ids`` / ``attention_mask`` / ``completion_mask``: the chosen half first, then the rejected half);
:func:`reward_batch` the same rows into what its ``RewardTrainer`` scores (``input_ids`` / ``attention_mask``, chosen
then rejected, each sequence ending with its answer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ray_jobs.data.pack import RecordRows
from ray_jobs.data.tokenize import IGNORE_INDEX, Examples

if TYPE_CHECKING:  # torch is imported where a batch is made
    import torch

PAD_CODE = -1


class PairPacker(RecordRows):
    """One row per preference record (no packing: DPO compares each pair's two sequences as wholes); fed the
    examples of :func:`fit_pairs`, chosen then rejected."""

    per_example = 2  # sequences a record's example is made of (the staging counts count records)

    def add(self, ex: Examples) -> np.ndarray:
        starts = np.concatenate([[0], np.cumsum(ex.lengths)])
        rows = np.empty((len(ex.lengths) // 2, 3, self.seq_len), dtype=np.int32)
        for i in range(len(rows)):
            (c0, c1), (r0, r1) = (starts[2 * i], starts[2 * i + 1]), (starts[2 * i + 1], starts[2 * i + 2])
            row = rows[i]
            row[0], row[1], row[2] = self.pad_id, IGNORE_INDEX, PAD_CODE
            row[0, : c1 - c0], row[1, : c1 - c0] = ex.ids[c0:c1], ex.labels[c0:c1]
            ids, learned = ex.ids[r0:r1], ex.labels[r0:r1] != IGNORE_INDEX
            row[2, : r1 - r0] = np.where(learned, ids, -(ids + 2))
        return rows


def pair_batch(
    ids: np.ndarray, labels: np.ndarray, coded: np.ndarray, pad_id: int, *, keep: np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """TRL's DPO batch of rows ``[B, seq_len]`` each (the three row parts): ``[2B, L]`` tensors, the chosen
    sequences first, cut to the longest sequence of the batch. A pair ``keep`` says False of (past ``train.epochs``'
    last pass) has no completion token: it moves nothing."""
    import torch

    chosen_completion = labels != IGNORE_INDEX
    chosen_len = np.where(chosen_completion.any(1), ids.shape[1] - np.argmax(chosen_completion[:, ::-1], 1), 0)
    if keep is not None:  # both completions read as prompt: attended to, never learned
        chosen_completion &= keep[:, None]
        coded = np.where(keep[:, None] | (coded < 0), coded, -coded - 2)
    chosen_attention = np.arange(ids.shape[1])[None, :] < chosen_len[:, None]
    rejected_attention = coded != PAD_CODE
    rejected_ids = np.where(coded >= 0, coded, np.where(rejected_attention, -coded - 2, pad_id))
    width = int(max(chosen_len.max(initial=1), rejected_attention.sum(1).max(initial=1)))
    out = {
        "input_ids": np.concatenate([np.where(chosen_attention, ids, pad_id), rejected_ids]),
        "attention_mask": np.concatenate([chosen_attention, rejected_attention]),
        "completion_mask": np.concatenate([chosen_completion, coded >= 0]),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v[:, :width]).astype(np.int64)) for k, v in out.items()}


def reward_batch(
    ids: np.ndarray, labels: np.ndarray, coded: np.ndarray, pad_id: int, *, keep: np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """TRL 1.16 RewardTrainer's batch of rows ``[B, seq_len]`` each (the three row parts), as its
    ``DataCollatorForPreference`` builds it: ``input_ids`` / ``attention_mask`` ``[2B, L]``, each pair's prompt +
    chosen answer, then each pair's prompt + rejected answer, cut to the longest. Each sequence ends with its
    answer's last learned token (its EOS or end-of-turn marker): whitespace a chat template writes after that marker
    is left out of both, so both scores are read alike (the model reads a sequence's score at its last token that is
    not the pad id). A pair ``keep`` says False of (past ``train.epochs``' last pass) has its chosen sequence on both
    sides: two equal rewards, a loss term of log 2 with no gradient (but for ``center_rewards_coefficient``'s pull
    towards 0)."""
    import torch

    chosen_len = learned_end(labels != IGNORE_INDEX)
    rejected_ids = np.where(coded >= 0, coded, np.where(coded != PAD_CODE, -coded - 2, pad_id))
    rejected_len = learned_end(coded >= 0)
    if keep is not None:
        rejected_ids = np.where(keep[:, None], rejected_ids, ids)
        rejected_len = np.where(keep, rejected_len, chosen_len)
    lengths = np.concatenate([chosen_len, rejected_len])
    attention = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    out = {"input_ids": np.where(attention, np.concatenate([ids, rejected_ids]), pad_id), "attention_mask": attention}
    width = int(lengths.max(initial=1))
    return {k: torch.from_numpy(np.ascontiguousarray(v[:, :width]).astype(np.int64)) for k, v in out.items()}


def learned_end(learned: np.ndarray) -> np.ndarray:
    """Per row of a ``[B, L]`` mask: one past its last learned position (0 when it has none)."""
    return np.where(learned.any(1), learned.shape[1] - np.argmax(learned[:, ::-1], 1), 0)
