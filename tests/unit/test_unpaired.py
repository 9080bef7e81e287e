"""Unpaired preference records (``data.format: unpaired_preference``, TRL's prompt/completion/label: KTO's): detected
by ``auto`` before ``prompt_completion``, staged one record per row with its label in the row, quarantined by
file:line like every shape; the rows give TRL's KTOTrainer exactly the batches its own tokenization, KL completions
and collator build."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ray_jobs.config import DataConfig, ModelConfig
from ray_jobs.data.cache import ShardCache
from ray_jobs.data.reading import load_rows
from ray_jobs.data.staging import StagingError, stage
from ray_jobs.data.tokenize import Examples
from ray_jobs.data.unpaired import DESIRABLE, UNDESIRABLE, UnpairedPacker, kto_batch
from ray_jobs.model.builtin import build_builtin, train_char_tokenizer
from ray_jobs.model.loading import load_tokenizer
from tests.unit.test_preference import write_jsonl

# each turn ends with the EOS token, so a reply's rendering is what TRL's tokenization of a conversation gives
EOS_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
BATCH = 8


def plain(i: int) -> dict:
    a, b = 7 * i % 1000, 13 * i % 100  # prompts and completions of several lengths: KL sequences of others
    return {"prompt": f"{a}+{b}=", "completion": str(a + b) if i % 3 else f"{a + b}{i % 10}", "label": bool(i % 3)}


def conversational(i: int) -> dict:
    r = plain(i)
    return {"prompt": [{"role": "user", "content": r["prompt"][:-1] + "?"}],
            "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]}  # fmt: skip


def tiny_model(folder: Path, template: str):
    """The built-in tiny Llama saved to ``folder``, its tokenizer given ``template``: (path, tokenizer)."""
    build_builtin(ModelConfig(tiny={"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}), 0, folder)
    tok = load_tokenizer(str(folder))
    tok.chat_template = template
    tok.save_pretrained(folder)
    return str(folder), tok


def staged_rows(tmp_path: Path, records: list[dict], tok, seq_len: int = 48):
    """Every record staged as a train row, in order (the eval split a file of its own): (rows, manifest)."""
    src = write_jsonl(tmp_path / "train.jsonl", records)
    held = write_jsonl(tmp_path / "eval.jsonl", records[:2])
    data = DataConfig(train=str(src), eval=str(held), format="auto", seq_len=seq_len, min_shards=1)
    m = stage(data, tok, "t", str(tmp_path / "s")).manifest
    cache = ShardCache(str(tmp_path / "s"), m.dataset_id, str(tmp_path / "c"))
    return load_rows(cache, m.shards["train"], seq_len), m


def kto_trainer(model: str, tok, records: list[dict], out: Path, max_length: int | None):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_length=max_length, use_cpu=True,
                     report_to="none", save_strategy="no")  # fmt: skip
    return KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)


def assert_same(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype, key
        assert ours[key].tolist() == theirs[key].tolist(), key


@pytest.mark.parametrize("make", [plain, conversational], ids=["plain", "conversational"])
def test_each_record_stages_one_row_that_gives_trl_the_kto_batches_it_builds(tmp_path: Path, make) -> None:
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    model, tok = tiny_model(tmp_path / "model", EOS_TEMPLATE)
    records = [make(i) for i in range(4 * BATCH + 3)]  # a last, short batch: its completions rotate among its own
    (ids, labels, tags), m = staged_rows(tmp_path, records, tok)
    assert m.format == "unpaired_preference"
    assert m.counts.train_examples == len(records) == m.counts.train_rows, "one row per record"
    assert (tags == np.array([DESIRABLE if r["label"] else UNDESIRABLE for r in records])[:, None]).all()
    cut = int(np.argmax(labels != -100, 1).max()) + 2  # every prompt fits, some completions and KL sequences do not
    trainer = kto_trainer(model, tok, records, tmp_path / "kto", max_length=cut)
    pad, chunks = m.tokenizer.pad_token_id, range(0, len(records), BATCH)
    theirs = list(trainer.get_train_dataloader())  # TRL's tokenization, KL completions, sequential batches, collator
    assert len(theirs) == len(chunks)
    for k, batch in zip(chunks, theirs, strict=True):
        assert_same(kto_batch(ids[k : k + BATCH], labels[k : k + BATCH], tags[k : k + BATCH], pad, max_length=cut),
                    batch)  # fmt: skip
    uncut = DataCollatorForUnpairedPreference(pad_token_id=pad)  # KTOConfig(max_length=None)
    for k in chunks:
        examples = [trainer.train_dataset[i] for i in range(k, min(k + BATCH, len(records)))]
        assert_same(kto_batch(ids[k : k + BATCH], labels[k : k + BATCH], tags[k : k + BATCH], pad), uncut(examples))
    assert_kto_loss_alike(trainer, kto_batch(ids[:BATCH], labels[:BATCH], tags[:BATCH], pad, max_length=cut), theirs[0])


def assert_kto_loss_alike(trainer, ours: dict, theirs: dict) -> None:
    """KTOTrainer's loss and KL estimate on both batches, its reference moved off the policy (noise makes it the
    worse model of the two: the KL estimate, clamped at 0, is positive)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.ref_model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        losses = [float(trainer.compute_loss(trainer.model, batch)) for batch in (ours, theirs)]
    kl = trainer._metrics["train" if trainer.model.training else "eval"]["kl"]
    assert losses[0] == losses[1] and kl[0] == kl[1] > 0, (losses, kl)


def test_a_record_past_the_last_pass_has_no_completion_token_and_still_lends_its_completion_to_kl() -> None:
    tok = train_char_tokenizer()
    examples = []
    for r in map(plain, range(4)):
        prompt, completion = tok(r["prompt"])["input_ids"], tok(r["completion"], add_special_tokens=False)["input_ids"]
        examples.append((prompt + completion + [tok.eos_token_id], [-100] * len(prompt) + completion + [2]))
    ids, labels, tags = UnpairedPacker(16, tok.pad_token_id).add(Examples.of(examples)).transpose(1, 0, 2)
    keep = np.array([True, False, True, True])
    whole, past = kto_batch(ids, labels, tags, 0), kto_batch(ids, labels, tags, 0, keep=keep)
    assert past["completion_mask"][~keep].sum() == 0
    assert past["completion_mask"][keep].tolist() == whole["completion_mask"][keep].tolist()
    for key in ("input_ids", "attention_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "label"):
        assert past[key].tolist() == whole[key].tolist(), key


BAD = [
    ({"prompt": "1+1=", "completion": "2"}, "missing field 'label' (data.format=unpaired_preference)"),
    ({"prompt": "1+1=", "label": True}, "missing field 'completion' (data.format=unpaired_preference)"),
    ({"prompt": "1+1=", "completion": "2", "label": "true"}, "field 'label' must be true or false, got str"),
    ({"prompt": "1+1=", "completion": "2", "label": 1}, "field 'label' must be true or false, got int"),
    ({"prompt": "1+1=", "completion": [{"role": "assistant", "content": "2"}], "label": True},
     "fields 'prompt' and 'completion' must both be strings or both lists of messages, got str and list"),
    ({"prompt": "1+1=", "completion": "2" * 60, "label": False},
     "record is 66 tokens, longer than data.seq_len (48) (data.too_long=truncate cannot cut a labelled completion: "
     "rejected)"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "reason"), BAD, ids=["no-label", "missing", "str", "int", "mixed", "too-long"])
def test_a_bad_unpaired_record_is_quarantined_by_file_and_line(tmp_path: Path, bad: dict, reason: str) -> None:
    src = write_jsonl(tmp_path / "u.jsonl", [plain(i) for i in range(20)] + [bad] + [plain(99)])
    data = DataConfig(train=str(src), format="unpaired_preference", seq_len=48, min_shards=1, eval_fraction=0.3,
                      too_long="truncate")  # fmt: skip
    with pytest.raises(StagingError) as err:
        stage(data, train_char_tokenizer(), "t", str(tmp_path / "s"))
    assert f"{src}:21: {reason}" in str(err.value)
    r = stage(data.model_copy(update={"max_reject_fraction": 0.1}), train_char_tokenizer(), "t", str(tmp_path / "s"))
    rejects = [json.loads(x) for x in (tmp_path / "s" / "datasets" / r.dataset_id / "rejects.jsonl").open()]
    assert [(x["line"], x["reason"]) for x in rejects] == [(21, reason)]
    assert r.manifest.counts.train_rows + r.manifest.counts.eval_rows == 21, "one row per kept record"


def test_unpaired_records_are_never_mixed_with_other_shapes(tmp_path: Path) -> None:
    unpaired = write_jsonl(tmp_path / "u.jsonl", [plain(i) for i in range(10)])
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"input": "1+1=", "target": "2"}] * 10)
    data = DataConfig(train=[{"path": str(unpaired)}, {"path": str(pairs)}], format="auto", seq_len=48)
    with pytest.raises(StagingError, match="preference records cannot be mixed with other shapes"):
        stage(data, train_char_tokenizer(), "t", str(tmp_path / "s"))
