"""Sample generations of a finished run: held-out prompts answered greedily by the base model and by the fine-tuned
one. Rank 0 of a training job makes them once it exported the final model, when its job spec asks (the finetune
flow's attempts do), and writes ``runs/<run>/samples.json`` (ray_jobs/contracts/samples.py) for the flow's summarize
task to publish.

The prompts come from the staged eval split -- the rows on storage the job already reads through its node cache,
token for token what the model was evaluated on -- never from the raw sources: on a remote cluster those may be a path
of the flow's host only (local data staged from there), and a run that trained must not fail over its samples. Any
failure here is a warning and no samples; the run's model is on storage either way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ray_jobs.config import Config
from ray_jobs.config.record_formats import staged_format
from ray_jobs.contracts.samples import Sample, Samples
from ray_jobs.data.tokenize import IGNORE_INDEX
from ray_jobs.storage import Layout, write_json_atomic
from ray_jobs.train.model import trains_reward_head

if TYPE_CHECKING:
    from ray_jobs.contracts.dataset import DatasetManifest
    from ray_jobs.data.reading import ShardRows

log = logging.getLogger("unbroken.samples")

MAX_NEW_TOKENS = 256  # a sample's answer is its target's length and 8 more, never longer than this


def staged_examples(rows: ShardRows, preference: bool, limit: int) -> list[tuple[list[int], list[int]]]:
    """Up to ``limit`` (prompt ids, target ids) of the staged eval split, in its order: each packed example (its
    position ids restart at 0) or each preference row (its chosen answer), the prompt being everything before its
    last learned stretch (a conversation up to its final reply) and the target that stretch."""
    out: list[tuple[list[int], list[int]]] = []
    for r in range(len(rows)):
        ids, labels, positions = (a[0] for a in rows.take(np.array([r])))
        for start, end in [(0, len(ids))] if preference else _examples(positions):
            example = _prompt_and_target(ids[start:end], labels[start:end])
            if example is not None:
                out.append(example)
            if len(out) == limit:
                return out
    return out


def _examples(positions: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each example packed into a row: its position ids restart at 0."""
    starts = [int(i) for i in np.flatnonzero(positions == 0)] or [0]
    return list(zip(starts, [*starts[1:], len(positions)], strict=True))


def _prompt_and_target(ids: np.ndarray, labels: np.ndarray) -> tuple[list[int], list[int]] | None:
    learned = np.flatnonzero(labels != IGNORE_INDEX)
    if len(learned) == 0:
        return None  # padding, or an example with nothing to learn
    gaps = np.flatnonzero(np.diff(learned) > 1)
    first = int(learned[gaps[-1] + 1]) if len(gaps) else int(learned[0])  # the last learned stretch
    if first == 0:
        return None  # no prompt to answer
    return [int(x) for x in ids[:first]], [int(x) for x in ids[first : int(learned[-1]) + 1]]


def greedy(model_path: str, cfg: Config, prompts: list[list[int]], budgets: list[int], device) -> list[str]:
    """Greedy completions of ``prompts`` (token ids, as staged) by the model at ``model_path``, each ``budget`` new
    tokens at most, on ``device`` -- in bf16 on a GPU that has it (a big model's two fp32 copies would not fit beside
    the trained one), fp32 on a CPU -- the model freed before the next one loads."""
    import torch

    from ray_jobs.model.loading import load_model, load_tokenizer

    gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if gpu and torch.cuda.is_bf16_supported() else torch.float32
    tok = load_tokenizer(model_path, cfg.data.cache_dir)
    model = load_model(model_path, cfg.data.cache_dir, dtype=dtype).to(device).eval()
    outputs = []
    try:
        for prompt, budget in zip(prompts, budgets, strict=True):
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=budget, do_sample=False, pad_token_id=tok.pad_token_id)
            outputs.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    finally:
        del model
        if gpu:
            torch.cuda.empty_cache()
    return outputs


def generate_samples(base_path: str, final_url: str, cfg: Config, rows: ShardRows, fmt: str, device) -> list[Sample]:
    """Held-out prompts of the staged eval ``rows`` (``fmt``: the staged format) answered by the base model
    (``before``) and the fine-tuned one (``output``). None when ``train.sample_generations`` is 0, for documents
    (``text``: no expected answer), or for a reward model (``train.method: reward``: it scores, it cannot generate)."""
    from ray_jobs.model.loading import load_tokenizer

    staged = staged_format(fmt)
    if cfg.train.sample_generations == 0 or staged.documents or trains_reward_head(cfg):
        return []
    examples = staged_examples(rows, staged.pairs, cfg.train.sample_generations)
    tok = load_tokenizer(base_path, cfg.data.cache_dir)
    prompts = [p for p, _ in examples]
    targets = [tok.decode(t, skip_special_tokens=True) for _, t in examples]
    budgets = [min(len(t) + 8, MAX_NEW_TOKENS) for _, t in examples]
    before = greedy(base_path, cfg, prompts, budgets, device)
    after = greedy(final_url, cfg, prompts, budgets, device)
    shown = [tok.decode(p, skip_special_tokens=True).strip() for p in prompts]
    return [
        {"prompt": question, "target": target, "before": b, "output": a, "exact": _same(a, target)}
        for question, target, b, a in zip(shown, targets, before, after, strict=True)
    ]


def write_samples(
    cfg: Config, base_path: str, final_url: str, rows: ShardRows, manifest: DatasetManifest, device
) -> str | None:
    """Generate the run's samples (:func:`generate_samples`) from the staged eval ``rows`` of ``manifest`` and write
    them to ``runs/<run>/samples.json``; its URL. A failure is the samples' alone -- a warning, no file: the run
    trained and its model is on storage."""
    try:
        fmt = str(manifest.staging_config.get("format", ""))
        samples = generate_samples(base_path, final_url, cfg, rows, fmt, device)
        url = Layout(cfg.storage).samples(cfg.name)
        write_json_atomic(url, Samples(base_model=base_path, final_model=final_url, samples=samples).dump())
    except Exception as e:  # whatever it was: never a trained run failed, never the job retried over it
        log.warning("no sample generations: %s: %s (the final model is written: %s)", type(e).__name__, e, final_url)
        return None
    log.info(
        "%d sample generations written to %s (exact match %d)", len(samples), url, sum(x["exact"] for x in samples)
    )
    return url


def _same(output: str, target: str) -> bool:
    """Exact match up to surrounding whitespace (special tokens such as an end-of-turn marker are not decoded)."""
    return output.strip() == target.strip()
