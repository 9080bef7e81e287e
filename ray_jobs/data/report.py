"""What staging made, as its manifest says it: the counts, a mixture's sources, and the one line that sums it up."""

from __future__ import annotations

from ray_jobs.config.record_formats import staged_format
from ray_jobs.contracts.dataset import Counts, DatasetManifest, MixedSource, Shard
from ray_jobs.data.fingerprint import Source
from ray_jobs.data.mixture import Mixture, source_rows, staged_rows
from ray_jobs.data.spill import Spill
from ray_jobs.secrets import mask


def counts_of(spill: Spill, shards: dict[str, list[Shard]]) -> Counts:
    """The spill's counts, and the rows of each split's shards (a mixture's train rows as its weights staged them;
    its tokens are its records', before weighting)."""
    c = spill.counts
    kept = {name: c[name] for name in Counts.model_fields if name in c}
    rows = {split: sum(s.rows for s in shards.get(split, [])) for split in ("train", "eval")}
    return Counts(**kept, train_rows=rows["train"], eval_rows=rows["eval"])


def mixed_sources(mix: Mixture, spill: Spill, files: list[Source]) -> list[MixedSource]:
    """Each source of a mixture as staging made it: its records and rejects (both splits), its train rows, and the
    rows its weight staged."""
    rows = source_rows(spill.marks)
    staged = staged_rows(rows, [s.weight for s in mix.sources])
    out, before = [], {"records": 0, "rejects": 0}
    for i, (src, mark) in enumerate(zip(mix.sources, spill.marks, strict=True)):
        out.append(
            MixedSource(
                source=src.field,
                where=mask(src.where, ()),
                weight=src.weight,
                format=src.format,
                files=sum(f.source == i for f in files),
                records=mark["records"] - before["records"],
                rejects=mark["rejects"] - before["rejects"],
                rows=rows[i],
                staged_rows=staged[i],
            )
        )
        before = mark
    return out


def summary(manifest: DatasetManifest) -> str:
    """What staging made of the records, in one line (the staging log's, and the flow's)."""
    counts, conf = manifest.counts, manifest.staging_config
    if staged_format(manifest.format).documents:
        out = (
            f"{counts.documents} documents -> {counts.pieces} pieces ({counts.cut_documents} cut into "
            f"pieces of at most {conf['seq_len']} tokens), {counts.train_tokens} train tokens"
        )
    else:
        out = f"{counts.records} records ({counts.rejects} rejected"
        if counts.dropped or counts.truncated:
            out += f", {counts.dropped} dropped and {counts.truncated} truncated by data.too_long={conf['too_long']}"
        out += f"), {counts.train_tokens} train tokens"
    if manifest.mixture:
        out += "; mixed: " + ", ".join(
            f"{m.source} {m.where} (weight {m.weight:g}): {m.records} records -> {m.rows} rows, staged "
            f"{m.staged_rows} (x{m.repeats:.2f})"
            for m in manifest.mixture
        )
    return out
