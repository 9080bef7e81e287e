"""What ``unbroken check`` looks at, without staging or training: the model (its config only, the module tree on the
meta device), the data sources (listed, their first records' fields) and the storage (a probe object written and
removed; conditional writes on an object store); the cluster is control/check/__init__.py's. Each returns findings;
a problem names the field and what to do."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING

from control.check import remembered
from control.check.findings import Finding, ok, problem, warning
from control.check.plan import ModelShape
from ray_jobs.config import Config, DataConfig
from ray_jobs.config.data import TrainSource
from ray_jobs.config.record_formats import record_format
from ray_jobs.errors import UserError

if TYPE_CHECKING:  # check imports without torch/transformers; the model probe imports them when it runs
    from transformers import PretrainedConfig, PreTrainedModel


def model(cfg: Config, build: bool = True) -> tuple[list[Finding], ModelShape | None]:
    """The model found (its config.json read: a folder, a storage URL, a hub id in the local cache or the hub), its
    module tree built on the meta device, and ``model.lora`` checked against it. ``build=False``: the tree is built
    only to check ``model.lora`` (a config.json that builds no model is the job's failure to report, as before).
    What a tree built once answered is remembered (control/check/remembered.py)."""
    if (build or cfg.model.lora is not None) and (known := remembered.recall(cfg)) is not None:
        return known[0], known[1] if build else None
    found, shape = _probe_model(cfg, build)
    if shape is not None:
        remembered.remember(cfg, found, shape)
    return found, shape


def _probe_model(cfg: Config, build: bool) -> tuple[list[Finding], ModelShape | None]:
    from ray_jobs.model.builtin import builtin_config, check_local_folder, is_builtin

    name = cfg.model.name_or_path
    try:
        if is_builtin(cfg.model):
            if not build and cfg.model.lora is None:
                return [], None
            lm, where = _meta(builtin_config(cfg.model)), "built-in, built on storage by the first run"
        else:
            check_local_folder(name)
            if not build and cfg.model.lora is None:
                return _config_read(name), None
            lm, where = _meta_of(name), "its config.json read"
    except UserError as e:
        return [problem("model", str(e).split("\n")[-1].strip(" -"))], None
    except OSError as e:  # transformers: not a folder, not in the hub cache, the hub unreachable
        return [problem("model", _unreadable(name, e))], None
    except Exception as e:  # a config.json transformers cannot build a model from
        return [
            problem("model", f"model.name_or_path: cannot build {name} from its config.json: {type(e).__name__}: {e}")
        ], None
    shape, lora_text = _shape(cfg, lm)
    found = [
        ok(
            "model",
            f"{name} ({type(lm).__name__}, {where}): {_millions(shape.params)} parameters, "
            f"{_millions(shape.trainable)} trained{lora_text}",
        )
    ]
    if cfg.model.lora is not None:
        from ray_jobs.model.lora import lora_problems

        found += [problem("model", p) for p in lora_problems(lm, cfg.model.lora, name)]
    return found, shape


def _config_read(name: str) -> list[Finding]:
    from ray_jobs.model.loading import config_dict

    config_dict(name)  # OSError: not found (the caller reports it)
    return [ok("model", f"{name}: its config.json read")]


def _millions(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def _unreadable(name: str, e: OSError) -> str:
    first = str(e).strip().split("\n")[0]
    return (
        f"model.name_or_path: cannot read {name}'s config.json ({first}). A hub id needs the hub, or the model "
        f"in the local Hugging Face cache (`hf download {name}` where the hub is reachable); a "
        "local model is a folder holding config.json"
    )


def _meta_of(name: str) -> PreTrainedModel:
    from ray_jobs.model.loading import meta_model

    return meta_model(name)


def _meta(config: PretrainedConfig) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _shape(cfg: Config, lm: PreTrainedModel) -> tuple[ModelShape, str]:
    c = lm.config
    params = sum(p.numel() for p in lm.parameters())  # parameters() yields a tied matrix once
    trainable, text = params, ""
    if (lora := cfg.model.lora) is not None:
        from ray_jobs.model.lora import targeted

        layers = [lm.get_submodule(n) for n in targeted(lm, lora.target_modules)]
        saved = sum(
            p.numel()
            for n, m in lm.named_modules()
            if any(n.endswith(s) for s in lora.modules_to_save)
            for p in m.parameters()
        )
        linear = [m for m in layers if hasattr(m, "in_features")]
        # torch types a module's attributes Tensor | Module: a linear layer's in/out_features are ints
        trainable = sum(lora.r * (m.in_features + m.out_features) for m in linear)  # ty: ignore[unsupported-operator]
        trainable += saved
        text = f" (LoRA r={lora.r} on {len(layers)} layers)"
    hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0)
    layers_n = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0)
    return ModelShape(params, trainable, int(hidden), int(layers_n), int(c.vocab_size)), text


def data(cfg: Config) -> list[Finding]:
    """Each source listed and the fields of its first records against ``data.format`` (detected from ``data.train``
    when ``auto``; ``data.eval`` is staged in the same format). Of a list of train sources, each in its own format; a
    hub dataset loaded as staging loads it (from the local cache when the hub does not answer: a miss is certain)."""
    from ray_jobs.data.hub import hub_file

    d, found, fmt = cfg.data, [], None
    for field, url, own in _named_sources(d):
        if isinstance(url, TrainSource):
            try:
                url = hub_file(url, field, d.work_dir)
            except UserError as e:
                found.append(problem("data", str(e)))
                continue
        finding, detected = _source(cfg, field, url, None if record_format(own).detected else own)
        fmt = fmt or detected
        found.append(finding)
    if d.eval:
        found.append(_source(cfg, "data.eval", d.eval, fmt if record_format(d.format).detected else d.format)[0])
    return found


def _named_sources(d: DataConfig) -> list[tuple[str, str | TrainSource, str]]:
    """(config field, path or URL -- a hub dataset's entry --, format) of each train source."""
    if isinstance(d.train, str):
        return [("data.train", d.train, d.format)]
    many = len(d.train) > 1
    return [
        (f"data.train[{i}]" if many else "data.train", e.path or e, e.format or d.format) for i, e in enumerate(d.train)
    ]


def _source(cfg: Config, field: str, url: str, fmt: str | None) -> tuple[Finding, str | None]:
    from ray_jobs.data.shapes import fields_of, resolve_format, sample_fields
    from ray_jobs.data.sources import list_sources

    d = cfg.data
    try:
        files = list_sources(url, field)
        first, samples = sample_fields(url, field)
    except UserError as e:  # a source the store did not serve may serve it when the run stages: not certain
        return (problem if e.users_fault else warning)("data", str(e)), fmt
    except Exception as e:  # a store's own error (permissions, a protocol without a filesystem)
        return warning("data", f"{field}: cannot read {url} now: {type(e).__name__}: {e}"), fmt
    where, keys = samples[0]
    if fmt is None:  # auto: detected as staging detects it (its sampled records agreeing), or refused as it refuses
        try:
            fmt = resolve_format(d.model_copy(update={"train": url, "format": "auto"})).format
        except UserError as e:
            return problem("data", str(e)), None
    missing = [k for k in fields_of(fmt, d) if k not in keys]
    if missing:
        text = f"data.format={d.format} needs {', '.join(missing)}; the first record of {first} ({where}) has " + (
            ", ".join(keys)
        )
        # certain only when no bad record is tolerated: otherwise staging rejects this one and goes on
        return (problem if d.max_reject_fraction == 0 else warning)("data", text), fmt
    detected = " (detected)" if record_format(d.format).detected else ""
    return ok("data", f"{field}: {len(files)} file(s); the first records ({first}) are {fmt}{detected}"), fmt


def storage(cfg: Config) -> list[Finding]:
    """A probe object written under ``storage`` and removed; on an object store, conditional writes tried."""
    from ray_jobs.coordination import check_conditional_writes
    from ray_jobs.storage import fs_and_path, is_local, join, write_bytes_atomic

    url = cfg.storage
    probe = join(url, f".unbroken-check-{uuid.uuid4().hex[:12]}")
    made = _missing_folders(url) if is_local(url) else []
    try:
        write_bytes_atomic(probe, b"unbroken check\n")
        fs, path = fs_and_path(probe)
        fs.rm(path)
        for folder in made:  # a check leaves nothing behind: the folders the probe made go too
            folder.rmdir()
        check_conditional_writes(url)
    except UserError as e:
        return [problem("storage", str(e))]
    except (OSError, ValueError) as e:  # s3fs: a missing bucket is FileNotFoundError, a refused PUT PermissionError
        return [problem("storage", f"cannot write to {url}: {type(e).__name__}: {e}")]
    leases = "local path: leases by exclusive create" if is_local(url) else "conditional writes honoured"
    return [ok("storage", f"{url}: writable; {leases}")]


def _missing_folders(url: str) -> list:
    """The folders of a local storage path that do not exist yet, deepest first."""
    from pathlib import Path

    from ray_jobs.storage import strip_protocol

    folder, out = Path(strip_protocol(url)).absolute(), []
    while not folder.exists() and folder != folder.parent:
        out.append(folder)
        folder = folder.parent
    return out


def local_gpus() -> int:
    """CUDA devices this machine has (what a local head's workers could use)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    import torch

    return torch.cuda.device_count()


def gpu_memory() -> float | None:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def machine_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def rewards(cfg: Config) -> list[Finding]:
    """Each of ``train.rewards`` found where unbroken runs (the working directory on the path) -- its module imported
    and the function in it -- so the job can ship its package and its workers import it by the same name."""
    import importlib

    from ray_jobs.config.train import code_path

    out = []
    for i, r in enumerate(cfg.train.rewards):
        module, _, name = r.function.partition(":")
        where = f"train.rewards[{i}].function"
        try:
            path = code_path(module)
        except ValueError as e:  # found nowhere
            out.append(problem("config", f"{where}: {e}"))
            continue
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except Exception as e:  # noqa: BLE001 -- the user's module, run on import: whatever it raises is theirs
            out.append(problem("config", f"{where}: importing {module} raised {type(e).__name__}: {e}"))
            continue
        if not callable(fn):
            out.append(problem("config", f"{where}: {module} has no function {name}"))
        else:
            out.append(ok("config", f"{where}: {r.function} (shipped with the job from {path})"))
    return out
