"""Unpaired preference records (``data.format: unpaired_preference``, TRL's KTO shape): a prompt, a completion and a
boolean ``label`` (true: the completion is desirable), staged one record per row in the row layout every other shape
uses (``[3, seq_len]`` int32), so the node cache, the resumable cursor, the row trace and the checkpoints serve KTO
unchanged:

- row 0: prompt + completion token ids, padded with the pad id;
- row 1: its labels: the completion's tokens (EOS included), IGNORE_INDEX on the prompt and the padding;
- row 2: the record's label in every column: ``DESIRABLE`` (1) or ``UNDESIRABLE`` (-1) -- never 0, so a reader that
  takes row 2 for position ids (restarting at 0 with each packed example) finds one example a row.

The label reaches the packer in the examples' labels (``tokenize.coded_undesirable``: an undesirable completion's
tokens coded below IGNORE_INDEX); the row holds them plain.

:func:`kto_batch` turns rows into what TRL's ``KTOTrainer`` computes its loss on: its
``DataCollatorForUnpairedPreference``'s tensors, the KL (mismatched) sequences included, built as TRL builds them.
The tokens are the staging's (as for every format): a plain record's are exactly TRL's (prompt + completion + EOS
tokenized once, the completion from where the prompt's tokens end); a conversation's are TRL's when the chat template
ends a reply with the EOS token, while staging adds an EOS (learned) after a reply a template does not end with one,
and TRL leaves that reply as rendered, whitespace after its end-of-turn marker included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ray_jobs.data.pack import RecordRows
from ray_jobs.data.preference import learned_end
from ray_jobs.data.tokenize import IGNORE_INDEX, Examples

if TYPE_CHECKING:  # torch is imported where a batch is made
    import torch

DESIRABLE, UNDESIRABLE = 1, -1


class UnpairedPacker(RecordRows):
    """One row per labelled record (no packing: KTO scores each completion whole, and pairs the prompts of a batch
    with each other's completions); fed the examples of ``tokenize.Tokenized``, an undesirable one's labels coded."""

    def add(self, ex: Examples) -> np.ndarray:
        starts = np.concatenate([[0], np.cumsum(ex.lengths)])
        rows = np.empty((len(ex.lengths), 3, self.seq_len), dtype=np.int32)
        for row, a, b in zip(rows, starts[:-1], starts[1:], strict=True):
            labels = ex.labels[a:b]
            undesirable = labels < IGNORE_INDEX  # coded_undesirable's tokens
            row[0], row[1] = self.pad_id, IGNORE_INDEX
            row[0, : b - a] = ex.ids[a:b]
            row[1, : b - a] = np.where(undesirable, IGNORE_INDEX - 1 - labels, labels)
            row[2] = UNDESIRABLE if undesirable.any() else DESIRABLE
        return rows


def kto_batch(
    ids: np.ndarray,
    labels: np.ndarray,
    tags: np.ndarray,
    pad_id: int,
    *,
    keep: np.ndarray | None = None,
    max_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """TRL 1.16 KTO's batch of rows ``[B, seq_len]`` each (the three row parts), the rows being one of its batches:
    ``input_ids`` / ``attention_mask`` / ``completion_mask`` of each prompt + completion; the same three ``KL_`` ones
    of each prompt followed by the completion of the row before it, the first row's by the last row's (TRL's KL
    completions: a batch's completions rotated by one, in dataset order, within each ``per_device_train_batch_size``
    chunk -- the batch its sequential sampler gives); ``label`` (bool, True: desirable). Each set is padded to its own
    longest sequence. ``max_length``: KTOConfig's, every sequence cut to it from the right as TRL's collator cuts (None:
    uncut; a staged sequence is never longer than ``seq_len``, a KL one may be). A row ``keep`` says False of (past
    ``train.epochs``' last pass) has no completion token: its own term moves nothing; its completion still serves
    the next row's KL sequence (the batch's KL estimate, computed without gradient, is TRL's)."""
    import torch

    learned = labels != IGNORE_INDEX
    start, end = np.argmax(learned, 1), learned_end(learned)
    prompts = [row[:s] for row, s in zip(ids, start, strict=True)]
    completions = [row[s:e] for row, s, e in zip(ids, start, end, strict=True)]
    own = np.ones(len(ids), dtype=bool) if keep is None else keep
    out = sequences(prompts, completions, own, pad_id, max_length)
    kl = sequences(prompts, completions[-1:] + completions[:-1], np.ones(len(ids), dtype=bool), pad_id, max_length)
    out.update({f"KL_{k}": v for k, v in kl.items()})
    out["label"] = torch.from_numpy(tags[:, 0] == DESIRABLE)
    return out


def sequences(
    prompts: list[np.ndarray], completions: list[np.ndarray], learn: np.ndarray, pad_id: int, max_length: int | None
) -> dict[str, torch.Tensor]:
    """Each prompt + completion, right-padded to the longest (cut to ``max_length`` first), with its attention mask
    and its completion mask (zero where ``learn`` is False)."""
    import torch

    joined = [np.concatenate([p, c])[:max_length] for p, c in zip(prompts, completions, strict=True)]
    width = max((len(s) for s in joined), default=0)
    out = {k: np.zeros((len(joined), width), dtype=np.int64) for k in ("attention_mask", "completion_mask")}
    input_ids = np.full((len(joined), width), pad_id, dtype=np.int64)
    for i, (seq, prompt) in enumerate(zip(joined, prompts, strict=True)):
        input_ids[i, : len(seq)] = seq
        out["attention_mask"][i, : len(seq)] = 1
        out["completion_mask"][i, len(prompt) : len(seq)] = int(learn[i])
    return {k: torch.from_numpy(v) for k, v in {"input_ids": input_ids, **out}.items()}
