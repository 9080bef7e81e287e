"""The one typed config tree for a run: YAML on disk, ``--set a.b=c`` overrides, validated once.

Lives in ``ray_jobs`` because the Ray job needs it and Prefect is not installed on workers; flows and tasks
import it from here. Every problem in a config is reported in one :class:`ConfigError` naming each field, and
loading never touches storage or a cluster.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-llama",)


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every bad field, one per line."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid {source} ({len(problems)} problem(s)):\n{lines}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class DataConfig(_Section):
    train: str
    """Training source: a JSONL or Parquet file, or a folder of them, as a local path or any fsspec URL (``s3://...``)."""
    eval: str | None = None
    """Optional separate eval source; when empty, ``eval_fraction`` of ``train`` is held out by record hash."""
    format: Literal["pairs", "text", "chat"] = "pairs"
    """``pairs``: prompt/completion fields, tokenized as one text (prompt masked from the loss); ``text``: one text
    field, all of it learned; ``chat``: a list of ``{role, content}`` messages rendered with the tokenizer's chat
    template, the assistant turns chosen by ``train_on`` learned."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """``chat``: learn every assistant turn of a conversation (the default), or only the final one."""
    input_field: str = "input"
    """``pairs``: record field holding the prompt; its tokens are masked from the loss."""
    target_field: str = "target"
    """``pairs``: record field holding the completion the model learns to produce."""
    text_field: str = "text"
    """``text``: record field holding the text."""
    messages_field: str = "messages"
    """``chat``: record field holding the list of messages; the last one must be the assistant's."""
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Share of records held out for eval (chosen by record hash, so adding records never reshuffles)."""
    seq_len: int = Field(256, ge=8)
    """Length in tokens of each packed training sequence."""
    max_record_chars: int = Field(100_000, ge=1)
    """A record whose input plus target is longer than this is rejected."""
    max_reject_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of bad records tolerated (they go to rejects.jsonl); above it staging fails. 0 = any reject fails."""
    shard_mb: float = Field(256.0, gt=0)
    """Target size of one Parquet shard on storage, in MB."""
    min_shards: int = Field(8, ge=1)
    """Write at least this many train shards, so up to this many ranks each read shards of their own."""
    workers: int = Field(0, ge=0)
    """Processes that validate and tokenize in parallel while staging; 0 = one per CPU core. Staged shards are the
    same for any number."""
    stage_on: Literal["local", "cluster", "auto"] = "auto"
    """Where staging runs: ``local`` (the flow's machine, a process per core), ``cluster`` (a Ray job whose actors
    read and tokenize the sources in parallel on every node; the sources must be readable from the cluster), or
    ``auto``: the cluster once the sources reach ``cluster_stage_mb`` and the cluster can read them (they are on an
    object store, or the cluster is a local head). The shards, manifest and dataset id are the same either way."""
    cluster_stage_mb: float = Field(1024.0, gt=0)
    """``stage_on: auto``: source size in MB from which staging runs on the cluster."""
    verify_sources: bool = False
    """Hash every source file in full on every staging, even when its size and version marker (mtime locally, ETag on
    S3) match what an earlier staging hashed. Off: a restage of unchanged sources reads none of their bytes."""
    work_dir: str = "/tmp/unbroken/staging"
    """Folder on the staging machine for staging's spill and progress files (about the packed size of the dataset
    on disk, never in memory); a killed staging resumes from there."""
    cache_dir: str = "/tmp/unbroken/cache"
    """Node-local folder where each node keeps the shards its ranks read (the same path on every node)."""
    cache_max_gb: float = Field(100.0, gt=0)
    """Size cap of ``cache_dir`` per node, in GB; other datasets' shards are evicted (least recently used first)."""
    allowed_sources: list[str] = []
    """URL or path prefixes a dataset event's ``dataset_uri`` may name (a served deployment trains on whatever an
    event says, so this is its allow-list); empty = the folder holding ``data.train``. Anything else is refused."""


class TinyModelConfig(_Section):
    hidden_size: int = Field(64, ge=8)
    """Width of the built-in tiny Llama."""
    num_layers: int = Field(2, ge=1)
    """Decoder layers of the built-in tiny Llama."""
    num_heads: int = Field(4, ge=1)
    """Attention heads of the built-in tiny Llama (must divide hidden_size)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width of the built-in tiny Llama."""
    max_position_embeddings: int = Field(1024, ge=8)
    """Longest sequence the built-in tiny Llama accepts, in tokens."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        return self


class LoraConfig(_Section):
    r: int = Field(8, ge=1)
    """Rank of the LoRA update matrices."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]
    """Names of the layers that get adapters, or ``all-linear``: every linear layer but the output head."""
    modules_to_save: list[str] = []
    """Modules trained in full next to the adapters (e.g. ``lm_head``, ``embed_tokens``); merged into the export."""


class ModelConfig(_Section):
    name_or_path: str = "builtin:tiny-llama"
    """Base model: a Hugging Face hub id, a local/fsspec folder saved with save_pretrained, or
    ``builtin:tiny-llama`` (a tiny Llama built from ``model.tiny`` with a locally trained tokenizer; no network)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the built-in tiny model; ignored for any other ``name_or_path``."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) instead of all weights; the final export is merged into a plain HF model."""
    init_from: Literal["base", "series-champion", "series-latest"] = "base"
    """Weights a run starts from: ``base`` = ``name_or_path``; ``series-champion`` / ``series-latest`` = the final
    model of the series' champion / newest succeeded run (warm start; falls back to ``base``, logged, when the
    series has none yet). Tokenization always follows ``name_or_path``: a warm start changes weights, not data."""

    @field_validator("name_or_path")
    @classmethod
    def _known_builtin(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        if v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {v!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
        return v


class TrainConfig(_Section):
    seed: int = 0
    """Seed for model init, data order and every RNG; same seed + same world size = same weights."""
    max_steps: int = Field(200, ge=1)
    """Optimizer steps to train for."""
    micro_batch_size: int = Field(8, ge=1)
    """Packed sequences per worker per forward pass."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    lr: float = Field(3e-4, gt=0)
    """Peak AdamW learning rate."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Decay after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to ``lr``."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    eval_every_steps: int = Field(50, ge=1)
    """Run eval every N steps (and always at step 0 and at the end)."""
    eval_max_batches: int = Field(0, ge=0)
    """Cap on eval micro-batches per worker; 0 = the whole eval split."""
    log_every_steps: int = Field(10, ge=1)
    """Write a metrics.jsonl line every N steps."""
    sample_generations: int = Field(64, ge=0)
    """Held-out prompts the run's summary answers greedily with the base model and the fine-tuned one (on the
    flow's machine, CPU is fine for small models); 0 = none (set 0 for models too big to load there)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: ``auto`` = bf16 autocast on GPU, fp32 on CPU. Weights and optimizer moments are always fp32
    (the base model is loaded in fp32 whatever dtype it was saved in)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    compile: bool = False
    """``torch.compile`` the model (in place: checkpoints keep their keys). Faster steps on a GPU after a compile of
    a minute or so at the start of every worker; numerics differ from eager, so resume a run with the setting it was
    started with for bit-identical weights."""
    deterministic: bool = True
    """Deterministic kernels (on GPU also ``CUBLAS_WORKSPACE_CONFIG``): a killed and resumed run ends bit-identical
    to an uninterrupted one. false = fastest kernels; resume then restores the same data order and state, but the
    weights are not bit-identical."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the final export; ``auto`` = the base model's own dtype (training always keeps fp32 weights)."""
    export_shard_mb: float = Field(5000.0, gt=0)
    """Largest safetensors file of the final export, in MB; a bigger model is split across files with an index
    (``save_pretrained``'s ``max_shard_size``)."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """``ddp`` replicates the model on every worker; ``fsdp`` shards it (FSDP2) for models too big for one device."""


class CheckpointConfig(_Section):
    every_steps: int = Field(100, ge=0)
    """Checkpoint every N optimizer steps; 0 = not by steps. The last step is always checkpointed."""
    every_minutes: float = Field(0.0, ge=0)
    """Also checkpoint when this many minutes passed since the last one (15-30 on real runs); 0 = off."""
    num_to_keep: int = Field(3, ge=1)
    """Keep this many checkpoints (Ray Train's CheckpointConfig): the newest, or the best by ``keep_best_by``."""
    keep_best_by: str | None = None
    """Keep the best checkpoints by this reported metric (lower is better, e.g. ``eval_loss``) instead of the newest."""
    async_write: bool = True
    """Write checkpoints on a background thread; the loop only waits while state is copied to host memory."""
    keep_after_success: int = Field(1, ge=0)
    """Once a run succeeded, delete all but this many of its newest checkpoints (its final model is kept)."""


class WorkerRange(_Section):
    min: int = Field(ge=1)
    """Fewest workers the run trains with (Ray Train waits for at least this many)."""
    max: int = Field(ge=1)
    """Most workers; also how the data is laid out (see ``num_workers``)."""


BACKENDS = ("local", "address", "ray-up", "kuberay")


class RayUpConfig(_Section):
    config: str = ""
    """The cluster YAML the Ray cluster launcher takes (``ray up``: provider, node types, setup and start commands),
    a path on the machine that runs the flow. Its ``cluster_name`` names the cluster."""
    dashboard_address: str = ""
    """The Jobs API as the flow reaches it (an SSH tunnel or port-forward: ``http://127.0.0.1:8265``; a load
    balancer); empty = ``http://<head IP>:8265``, the head's address as the launcher reports it."""
    up_timeout_s: float = Field(900.0, gt=0)
    """How long ``up`` waits for the head's Jobs API to answer once the launcher is done."""

    @field_validator("dashboard_address")
    @classmethod
    def _http(cls, v: str) -> str:
        return _jobs_api_url(v)


class KubeRayConfig(_Section):
    image: str = ""
    """The container image of every Ray pod (Ray 2.60 and this project's dependencies installed, like
    ``rayproject/ray:2.60.0-py311-gpu`` plus ``pip install unbroken``)."""
    namespace: str = "default"
    name: str = ""
    """The RayCluster's name; empty = ``unbroken-<series>`` (one per series: its runs take turns on it)."""
    context: str = ""
    """The kubeconfig context to use; empty = the current one (or the in-cluster service account)."""
    head_cpus: str = "2"
    head_memory: str = "8Gi"
    worker_cpus: str = "8"
    """CPU request and limit of each worker pod (one pod per training worker)."""
    worker_memory: str = "32Gi"
    gpus_per_worker: int = Field(0, ge=0)
    """``nvidia.com/gpu`` per worker pod; ``cluster.use_gpu`` needs at least 1."""
    node_selector: dict[str, str] = {}
    """Worker pods' ``nodeSelector`` (``{cloud.google.com/gke-accelerator: nvidia-l4}``)."""
    tolerations: list[dict[str, Any]] = []
    """Worker pods' tolerations (``[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]``)."""
    s3_secret: str = ""
    """A Secret whose keys (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ...) become every Ray container's
    environment: how pods reach ``s3://`` storage. Empty: the pods' own identity (IRSA, workload identity)."""
    storage_pvc: str = ""
    """A ReadWriteMany PersistentVolumeClaim mounted on every pod at ``storage`` (a local-path storage must be one:
    a pod's own disk does not outlive it)."""
    auth_secret: str = ""
    """A Secret holding the Ray auth token under ``auth_token`` (``authOptions.secretName``); empty = KubeRay
    generates one per cluster, and the flow reads it from the Secret named like the cluster."""
    dashboard_address: str = ""
    """The Jobs API as the flow reaches it (a port-forward, an ingress); empty = the head Service's in-cluster DNS
    name, ``http://<name>-head-svc.<namespace>.svc.cluster.local:8265`` (a flow running in the cluster)."""
    ready_timeout_s: float = Field(600.0, gt=0)
    """How long ``up`` waits for the RayCluster to be ready (pods scheduled, images pulled, Ray started)."""

    @field_validator("dashboard_address")
    @classmethod
    def _http(cls, v: str) -> str:
        return _jobs_api_url(v)


def _jobs_api_url(v: str) -> str:
    v = v.strip()
    if v and not re.match(r"^https?://[^/\s]+", v):
        raise ValueError(f"must be the Jobs API URL, like http://head-node:8265 (got {v!r})")
    return v.rstrip("/")


class ClusterConfig(_Section):
    backend: Literal["local", "address", "ray-up", "kuberay"] | None = None
    """How the run gets its Ray cluster: ``local`` (a head on this machine), ``address`` (an existing cluster at
    ``cluster.address``), ``ray-up`` (the Ray cluster launcher, ``cluster.ray_up``), ``kuberay`` (a RayCluster on
    Kubernetes, ``cluster.kuberay``). Unset: ``address`` when an address is given, else ``local``."""
    address: str = ""
    """Ray Jobs API address of an existing cluster (``http://head:8265``); empty = start a local head."""
    python: str = "python"
    """The interpreter the jobs run with on a cluster unbroken did not start itself (``address``, ``ray-up``,
    ``kuberay``): the one with this project's dependencies, like ``~/unbroken-venv/bin/python`` (a login shell on a
    node may put another ``python`` first). A local head uses the flow's own interpreter."""
    ray_up: RayUpConfig = RayUpConfig()
    kuberay: KubeRayConfig = KubeRayConfig()
    num_workers: int | WorkerRange = 2
    """Ray Train workers (ranks): a number, or ``{min, max}`` for an elastic run (Ray Train restarts with as many as
    the cluster has room for after losing a node, and grows back when nodes return). The data is always laid out
    for ``max`` workers and the global batch (``max`` x ``train.micro_batch_size`` x ``train.grad_accum_steps``) is
    kept at every world size, gradient accumulation adjusted: every training row of an epoch is used exactly once
    whatever the world size did."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long a run waits for the cluster to have room for ``num_workers`` (its ``min``) before failing, before
    anything is submitted (nodes may still be joining: an autoscaler, a host restarting)."""
    resize_check_s: float = Field(60.0, gt=0)
    """Elastic runs: how often Ray Train checks whether more workers fit and, if so, restarts the group bigger
    (``ScalingConfig.elastic_resize_monitor_interval_s``)."""
    use_gpu: bool = False
    """One GPU per worker, NCCL backend; false = CPU workers with gloo."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved per worker."""
    head_port: int = Field(6379, ge=1, le=65535)
    """GCS port of a local head started by unbroken."""
    dashboard_port: int = Field(8265, ge=1, le=65535)
    """Dashboard / Jobs API port of a local head started by unbroken (bound to 127.0.0.1)."""
    keep_running: bool = False
    """Leave a local head that unbroken started running after the flow ends."""
    env_passthrough: list[str] = [
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
        "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    ]  # fmt: skip
    """Variables of the flow's environment a local head (and so every job on it) gets, besides what a process
    needs to run (PATH, HOME, locale, ``RAY_*``). Default: the S3 storage credentials. Add ``HF_TOKEN`` here if
    jobs load gated hub models; ``PREFECT_API_KEY`` and the like never reach jobs unless listed."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        """One clear message whatever is wrong (not one per shape the union allows)."""
        if isinstance(v, WorkerRange):
            v = v.model_dump()
        if isinstance(v, bool) or not isinstance(v, int | dict):
            raise ValueError(f"must be a number of workers or {{min, max}} (got {v!r})")
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be at least 1 (got {v})")
        if isinstance(v, dict):
            if set(v) != {"min", "max"} or not all(isinstance(x, int) and not isinstance(x, bool) for x in v.values()):
                raise ValueError(f"an elastic size is {{min: N, max: M}} with whole numbers (got {v!r})")
            if v["min"] < 1:
                raise ValueError(f"min must be at least 1 (got {v['min']})")
            if v["min"] > v["max"]:
                raise ValueError(f"min ({v['min']}) is above max ({v['max']})")
            if v["min"] == v["max"]:
                return v["min"]  # not elastic: the plain number
        return v

    @property
    def min_workers(self) -> int:
        n = self.num_workers
        return n.min if isinstance(n, WorkerRange) else n

    @property
    def max_workers(self) -> int:
        """Also the data layout's number of ranks (virtual ranks, whatever the world size)."""
        n = self.num_workers
        return n.max if isinstance(n, WorkerRange) else n

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    @property
    def backend_name(self) -> str:
        return self.backend or ("address" if self.address else "local")

    @field_validator("address")
    @classmethod
    def _http_address(cls, v: str) -> str:
        return _jobs_api_url(v)


class PhaseStallConfig(_Section):
    starting: float = Field(1800.0, gt=0)
    """Seconds from submitting a job to its first heartbeat (Ray schedules workers, ships the code)."""
    loading: float = Field(1800.0, gt=0)
    """Seconds for loading the model, the data and a checkpoint."""
    evaluating: float = Field(1800.0, gt=0)
    """Seconds one eval pass may take."""
    checkpointing: float = Field(1800.0, gt=0)
    """Seconds a synchronous checkpoint (the last step's, a preemption's) may take."""
    exporting: float = Field(3600.0, gt=0)
    """Seconds writing the final model folder may take (merging LoRA, multi-GB uploads)."""


class FaultToleranceConfig(_Section):
    max_failures: int = Field(2, ge=-1)
    """Worker-group restarts Ray Train does inside one job (FailureConfig); -1 = unlimited."""
    max_restarts: int = Field(3, ge=0)
    """Job resubmissions the watchdog may do for one run."""
    restart_backoff_s: float = Field(2.0, ge=0)
    """The watchdog waits this long after detecting trouble before the first restart, doubling for each further one
    (2, 4, 8 ... s up to ``restart_backoff_max_s``): a one-off fault is back at once, a crash loop slows down."""
    restart_backoff_max_s: float = Field(600.0, ge=0)
    """Cap on that wait."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """A training job whose heartbeat shows no new step for this long is treated as hung (the ``training`` phase;
    other phases have their own limits in ``phase_stall_s``)."""
    phase_stall_s: PhaseStallConfig = PhaseStallConfig()
    """How long a job may stay in each non-training phase before it counts as hung."""
    confirm_s: float = Field(30.0, ge=0)
    """An ambiguous sign of trouble (the Jobs API unreachable, a 5xx or 401, a job the cluster suddenly does not
    know) is acted on only when it held this long, over several observations. A definitive one (the job FAILED,
    a phase over its limit) is acted on at once."""
    progress_resets_budget_steps: int = Field(100, ge=0)
    """An attempt that trained at least this many new steps before it failed resets the restart count: a long run
    on flaky nodes is not given up on for failures spread over days. 0 = never reset."""
    heartbeat_every_s: float = Field(5.0, gt=0)
    """How often rank 0 refreshes ``runs/<run>/heartbeat.json`` while training."""
    preemption_grace_s: float = Field(30.0, gt=0)
    """After SIGTERM, a worker waits at most this long for its just-in-time checkpoint before exiting."""
    max_preemptions: int = Field(-1, ge=-1)
    """Node preemptions (a drain notice with a deadline: a spot reclaim, ``ray drain-node``) Ray Train absorbs
    inside one job, counted apart from ``max_failures`` (``FailureConfig.max_preemption_failures``); -1 = unlimited.
    Each one costs no step: every rank checkpoints at once and waits for the restart."""
    preemption_poll_s: float = Field(2.0, gt=0)
    """How often the ranks ask Ray Train whether a node of theirs is being drained (one barrier across ranks, at a
    step boundary). Ray's own watcher polls the cluster every 5 s; a notice is acted on within both."""


class SeriesConfig(_Section):
    name: str | None = None
    """The lineage this run belongs to; default: ``name`` with its placeholders (and the separators around them)
    removed, so ``nightly-{dataset}`` is series ``nightly``."""
    eval: str | None = None
    """The series' fixed eval set (JSONL/Parquet file or folder, like ``data.train``), staged once and pinned by its
    dataset id; every finished run is scored on it. Default: the eval split of the series' first run, pinned."""
    min_improvement: float = Field(0.0, ge=0, lt=1)
    """A run becomes champion only if its score beats the champion's by this fraction (0.01 = 1 % lower loss)."""
    keep_runs: int | None = Field(None, ge=1)
    """Keep the final models of at most this many succeeded non-champion runs (oldest deleted first); None = all."""

    @field_validator("name")
    @classmethod
    def _series_name(cls, v: str | None) -> str | None:
        if v is not None and not RUN_NAME.fullmatch(v):
            raise ValueError(f"{v!r} {RUN_NAME_RULE}")
        return v


RUN_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
RUN_NAME_RULE = "must be 1-63 lowercase letters, digits or '-', starting with a letter or digit"
# What a run name template may say, and a value of each one's shape (to check a template renders to a valid name).
PLACEHOLDERS = {"dataset": "0123abcd", "date": "20261123", "time": "235959"}
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def render_name(template: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def series_of(template: str) -> str:
    """``nightly-{dataset}`` -> ``nightly``: the placeholders and the separators around them removed."""
    parts = [p.strip("-") for p in _PLACEHOLDER.split(template)[::2]]
    return "-".join(p for p in parts if p)


def name_values(dataset_id: str, at: float) -> dict[str, str]:
    """What a run name template's placeholders resolve to for a dataset, at a time (UTC)."""
    import time

    t = time.gmtime(at)
    return {"dataset": dataset_id.removeprefix("ds-")[:8], "date": time.strftime("%Y%m%d", t),
            "time": time.strftime("%H%M%S", t)}  # fmt: skip


class Config(_Section):
    name: str
    """Run name: names the run folder, the Ray Train run and the Ray job submissions. May be a template with
    ``{dataset}`` (short content id of the staged dataset), ``{date}`` (UTC YYYYMMDD), ``{time}`` (UTC HHMMSS),
    resolved once per flow run: ``nightly-{dataset}`` makes every new dataset a new run of series ``nightly``."""
    series: SeriesConfig = SeriesConfig()
    """The lineage of runs this one belongs to: warm starts, the promotion gate and its champion."""
    storage: str
    """Shared storage root, any fsspec URL: a local/NFS path or ``s3://bucket/prefix``."""
    data: DataConfig
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()

    @field_validator("name")
    @classmethod
    def _run_name(cls, v: str) -> str:
        unknown = sorted({p for p in _PLACEHOLDER.findall(v) if p not in PLACEHOLDERS})
        if unknown:
            known = ", ".join(f"{{{k}}}" for k in PLACEHOLDERS)
            raise ValueError(f"unknown placeholder {', '.join(f'{{{u}}}' for u in unknown)} (known: {known})")
        example = render_name(v, PLACEHOLDERS)
        if not RUN_NAME.fullmatch(example):
            shown = f" (renders like {example!r})" if example != v else ""
            raise ValueError(f"{v!r}{shown} {RUN_NAME_RULE}")
        return v

    @property
    def is_template(self) -> bool:
        return bool(_PLACEHOLDER.search(self.name))

    @property
    def series_name(self) -> str:
        return self.series.name or series_of(self.name)

    def resolved(self, dataset_id: str, at: float) -> Config:
        """This config with its run name template resolved (and its series named, so the run's recorded config
        still knows its series)."""
        return self.named(render_name(self.name, name_values(dataset_id, at)))

    def named(self, run: str) -> Config:
        """This config as the run a template resolved to (known from elsewhere: the series registry)."""
        out = self.model_copy(deep=True)
        out.series.name = self.series_name
        out.name = run
        return out

    @field_validator("storage")
    @classmethod
    def _storage_url(cls, v: str) -> str:
        return _check_url(v)

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.series.name is None and not series_of(self.name):
            raise ValueError(f"series.name: name {self.name!r} is only placeholders; name the series")
        if self.model.lora is not None and self.train.parallelism == "fsdp":
            raise ValueError("model.lora with train.parallelism=fsdp is not supported yet; use ddp for LoRA")
        problem = batch_split_problem(self.cluster.min_workers, self.cluster.max_workers, self.train.grad_accum_steps)
        if problem:
            raise ValueError(f"cluster.num_workers: {problem}")
        builtin = self.model.name_or_path.startswith(BUILTIN_PREFIX)
        if builtin and self.data.seq_len > self.model.tiny.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.tiny.max_position_embeddings "
                f"({self.model.tiny.max_position_embeddings})"
            )
        return self


def batch_split_problem(lo: int, hi: int, grad_accum_steps: int) -> str | None:
    """Why a global batch of ``hi`` x ``grad_accum_steps`` micro-batches cannot be split evenly over every world size
    from ``lo`` to ``hi`` (each worker must run the same number of micro-batches per step), or None."""
    import math

    slots = hi * grad_accum_steps
    bad = [w for w in range(lo, hi + 1) if slots % w]
    if not bad:
        return None
    every = math.lcm(*range(lo, hi + 1))
    need = every // math.gcd(every, hi)  # the smallest grad_accum_steps that splits evenly at every size
    return (
        f"the global batch is {hi} x train.grad_accum_steps={grad_accum_steps} = {slots} micro-batches, which "
        f"{', '.join(map(str, bad))} worker(s) cannot share evenly; set train.grad_accum_steps to a multiple of "
        f"{need}, or narrow min..max"
    )


def _check_url(v: str) -> str:
    import fsspec  # light; only its registry is read

    v = v.strip()
    if not v:
        raise ValueError("must not be empty")
    if "://" in v:
        protocol = v.split("://", 1)[0]
        if protocol not in fsspec.registry and protocol not in fsspec.available_protocols():
            raise ValueError(f"unknown storage protocol {protocol!r}")
    return v


def absolute_url(url: str | None) -> str | None:
    """Local relative paths become absolute (the job runs elsewhere); URLs are left alone."""
    if not url or "://" in url:
        return url
    return str(Path(os.path.expanduser(url)).resolve())


def parse_overrides(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``["a.b=1", "c=x"]`` -> nested dict, with YAML typing of values; returns (tree, problems)."""
    tree: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, like train.max_steps=100")
            continue
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"--set {item!r}: {part} is not a section")
                break
        else:
            node[parts[-1]] = _override_value(raw)
    return tree, problems


def _override_value(raw: str) -> Any:
    """YAML typing (``1`` is an int, ``[a, b]`` a list), except that a run name template stays a string:
    ``{date}-{dataset}`` would be YAML's flow mapping (or a syntax error)."""
    raw = raw.strip()
    if re.fullmatch(r"(?:[^{}]*\{\w*\})+[^{}]*", raw):
        return raw
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"cannot read config file: {e}"], str(path)) from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError([f"{where}: not valid YAML: {getattr(e, 'problem', e)}"], str(path)) from e
    if not isinstance(data, dict):
        raise ConfigError(["top level must be a mapping of sections"], str(path))
    return data


def _field_name(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def validate(raw: dict[str, Any], source: str = "config") -> Config:
    """Validate a raw tree; every problem is collected into one ConfigError (the cluster backend's checks too,
    which read its files: a ``ray up`` YAML)."""
    problems: list[str] = []
    cfg = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            msg = ("unknown key" if err["type"] == "extra_forbidden" else err["msg"]).removeprefix("Value error, ")
            named = not err["loc"] and re.match(r"[a-z_]+(\.[a-z_]+)*: ", msg)  # a cross-field check names its field
            problems.append(msg if named else f"{_field_name(err['loc'])}: {msg}")
    cluster = cfg.cluster if cfg is not None else _cluster_alone(raw)
    if cluster is not None:
        problems += cluster_problems(cluster, str(raw.get("storage") or ""))
    if problems:
        raise ConfigError(problems, source)
    cfg.storage = absolute_url(cfg.storage)
    cfg.data.train = absolute_url(cfg.data.train)
    cfg.data.eval = absolute_url(cfg.data.eval)
    cfg.cluster.ray_up.config = absolute_url(cfg.cluster.ray_up.config) or ""
    if not cfg.model.name_or_path.startswith(BUILTIN_PREFIX) and Path(cfg.model.name_or_path).exists():
        cfg.model.name_or_path = absolute_url(cfg.model.name_or_path)
    return cfg


def _cluster_alone(raw: dict[str, Any]) -> ClusterConfig | None:
    """The cluster section on its own, when the whole config did not validate (its own errors are reported)."""
    try:
        return ClusterConfig.model_validate(raw.get("cluster") or {})
    except ValidationError:
        return None


def cluster_problems(c: ClusterConfig, storage: str) -> list[str]:
    """What about the cluster backend cannot work, each naming its field: a backend missing what it needs, settings
    of a backend not in use, GPUs asked of a cluster that declares none. Reads the ``ray up`` YAML (so it runs where
    the config is loaded, not in the job)."""
    out: list[str] = []
    name = c.backend_name
    if name == "address" and not c.address:
        out.append("cluster.address: cluster.backend is address, but no address is given (http://head:8265)")
    if name != "address" and c.address:
        out.append(f"cluster.address: given, but cluster.backend is {name} (an address is for backend address)")
    for section, owner in (("ray_up", "ray-up"), ("kuberay", "kuberay")):
        if name != owner and getattr(c, section) != type(getattr(c, section))():  # not its defaults
            out.append(f"cluster.{section}: set, but cluster.backend is {name} (set cluster.backend: {owner})")
    if name == "ray-up":
        out += _ray_up_problems(c)
    if name == "kuberay":
        k = c.kuberay
        if not k.image:
            out.append("cluster.kuberay.image: cluster.backend kuberay needs the Ray image of its pods")
        if c.use_gpu and k.gpus_per_worker < 1:
            out.append("cluster.kuberay.gpus_per_worker: cluster.use_gpu needs at least 1 GPU per worker pod (got 0)")
        if storage and "://" not in storage and not k.storage_pvc:
            out.append(f"cluster.kuberay.storage_pvc: storage {storage} is a path; on Kubernetes it must be a "
                       "ReadWriteMany volume mounted on every pod (name its PVC), or use s3:// storage")  # fmt: skip
    return out


def _ray_up_problems(c: ClusterConfig) -> list[str]:
    path = c.ray_up.config
    if not path:
        return ["cluster.ray_up.config: cluster.backend ray-up needs the cluster YAML (what `ray up` takes)"]
    try:
        text = Path(os.path.expanduser(path)).read_text(encoding="utf-8")
    except OSError as e:
        return [f"cluster.ray_up.config: cannot read {path}: {e.strerror or e}"]
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"cluster.ray_up.config: {path} is not valid YAML: {getattr(e, 'problem', e)}"]
    if not isinstance(spec, dict):
        return [f"cluster.ray_up.config: {path} is not a cluster YAML (a mapping with cluster_name, provider, ...)"]
    out = [f"cluster.ray_up.config: {path} has no {key}" for key in ("cluster_name", "provider") if not spec.get(key)]
    types = spec.get("available_node_types") or {}
    declared = [t.get("resources") for t in types.values() if isinstance(t, dict)]
    if (
        c.use_gpu
        and declared
        and all(isinstance(r, dict) for r in declared)
        and not any(r.get("GPU") for r in declared)
    ):
        out.append(f"cluster.use_gpu: the cluster YAML {path} gives none of its node types a GPU "
                   "(available_node_types.*.resources)")  # fmt: skip
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (optional), apply ``--set`` overrides, validate; raises ConfigError naming every bad field."""
    raw = _read_yaml(path) if path is not None else {}
    tree, problems = parse_overrides(overrides or [])
    if problems:
        raise ConfigError(problems, str(path or "overrides"))
    return validate(_merge(raw, tree), str(path or "config"))


def from_json(text: str) -> Config:
    """The inverse of ``Config.model_dump_json()``: how the Ray job receives its config."""
    return Config.model_validate_json(text)


def job_spec(prog: str, argv: list[str] | None = None) -> tuple[dict, Config]:
    """What a Ray Jobs entrypoint (``python -m <prog> --spec <url>``) was given: the spec, and its config parsed."""
    import argparse
    import json

    from ray_jobs.storage import read_json

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--spec", required=True, help="URL of the job spec JSON the flow wrote to storage")
    spec = read_json(parser.parse_args(argv).spec)
    return spec, from_json(json.dumps(spec["config"]))
