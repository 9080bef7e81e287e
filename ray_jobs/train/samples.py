"""Sample generations of a finished run: held-out prompts answered greedily by the base model and by the fine-tuned
one, read from the eval split as staging read it (the resolved format, the same chat renderer). Rank 0 of a training
job makes them once it exported the final model, when its job spec asks (the finetune flow's attempts do), and writes
``runs/<run>/samples.json`` (ray_jobs/contracts/samples.py) for the flow's summarize task to publish."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ray_jobs.config import Config, DataConfig
from ray_jobs.contracts.samples import Sample, Samples
from ray_jobs.storage import Layout, write_json_atomic

if TYPE_CHECKING:
    from ray_jobs.data.records import Renderer


log = logging.getLogger("unbroken.samples")


def eval_examples(cfg: Config, limit: int, model_path: str) -> list[tuple[str, str, str, bool]]:
    """Up to ``limit`` (shown, prompt, target, templated) from the held-out eval split, in source order: what a
    person would read as the question, the prompt as staging rendered it (a conversation up to the final reply,
    template applied), the expected completion, and whether the chat template wrote the prompt (its special tokens
    included). Records are read as staging read them: the resolved format, the same renderer."""
    from ray_jobs.data.records import batch_records
    from ray_jobs.data.shapes import resolve_format
    from ray_jobs.data.sources import list_sources, read_batches
    from ray_jobs.data.staging import record_in_eval

    data = resolve_format(cfg.data)
    if data.eval:
        urls, keep = list_sources(data.eval, "data.eval"), lambda r: True
    else:
        urls, keep = list_sources(data.train, "data.train"), lambda r: record_in_eval(r, data.eval_fraction)
    render = _chat_renderer(data, model_path)
    out: list[tuple[str, str, str, bool]] = []
    for url in urls:  # a batch at a time, stopping once there are enough: memory stays one batch
        for batch in read_batches(url):
            out += [(r.shown or r.prompt, r.prompt, r.target, r.templated)
                    for r in batch_records(batch, data, "train", render)[0] if keep(r)]  # fmt: skip
            if len(out) >= limit:
                return out[:limit]
    return out


def _chat_renderer(data: DataConfig, model_path: str) -> Renderer | None:
    """The renderer staging used for ``data`` with this model's tokenizer (None where records are not rendered)."""
    from ray_jobs.data.workers import BatchWork
    from ray_jobs.model.loading import load_tokenizer

    return BatchWork(load_tokenizer(model_path, data.cache_dir), model_path, data).render()


def greedy(model_path: str, cfg: Config, prompts: list[str], targets: list[str], templated: list[bool]) -> list[str]:
    """Greedy completions of ``prompts`` by the model at ``model_path`` (plain transformers, fp32, CPU), each a
    little longer than its target. Prompts are encoded as staging encoded them: one the chat template wrote
    (``templated``) already holds its special tokens; a plain prompt gets the tokenizer's own (e.g. BOS)."""
    import torch

    from ray_jobs.model.loading import load_model, load_tokenizer

    tok = load_tokenizer(model_path, cfg.data.cache_dir)
    model = load_model(model_path, cfg.data.cache_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt, target, rendered in zip(prompts, targets, templated, strict=True):
        ids = torch.tensor([tok(prompt, add_special_tokens=not rendered)["input_ids"]])
        budget = len(tok(target, add_special_tokens=False)["input_ids"]) + 8
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=budget, do_sample=False, pad_token_id=tok.pad_token_id)
        outputs.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return outputs


def generate_samples(base_path: str, final_url: str, cfg: Config) -> list[Sample]:
    """Held-out prompts answered by the base model (``before``) and the fine-tuned one (``output``).

    For every format whose records have a prompt and an expected completion (all but ``text``, ``auto`` resolved
    first); none when ``train.sample_generations`` is 0.
    """
    from ray_jobs.data.shapes import resolve_format

    if cfg.train.sample_generations == 0:
        return []
    cfg = cfg.model_copy(update={"data": resolve_format(cfg.data)})
    if cfg.data.format == "text":
        return []
    examples = eval_examples(cfg, cfg.train.sample_generations, base_path)
    prompts, targets, templated = [x[1] for x in examples], [x[2] for x in examples], [x[3] for x in examples]
    before = greedy(base_path, cfg, prompts, targets, templated)
    after = greedy(final_url, cfg, prompts, targets, templated)
    return [
        {"prompt": shown, "target": target, "before": b, "output": a, "exact": _same(a, target)}
        for (shown, _, target, _), b, a in zip(examples, before, after, strict=True)
    ]


def write_samples(cfg: Config, base_path: str, final_url: str) -> str:
    """Generate the run's samples (:func:`generate_samples`) and write them to ``runs/<run>/samples.json``; its URL."""
    samples = generate_samples(base_path, final_url, cfg)
    url = Layout(cfg.storage).samples(cfg.name)
    write_json_atomic(url, Samples(base_model=base_path, final_model=final_url, samples=samples).dump())
    log.info(
        "%d sample generations written to %s (exact match %d)", len(samples), url, sum(x["exact"] for x in samples)
    )
    return url


def _same(output: str, target: str) -> bool:
    """Exact match up to surrounding whitespace (special tokens such as an end-of-turn marker are not decoded)."""
    return output.strip() == target.strip()
