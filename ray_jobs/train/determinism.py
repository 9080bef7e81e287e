"""Same seed + same world size = same weights: seeds, thread count and (with ``train.deterministic``) kernels."""

from __future__ import annotations

import os
from typing import NotRequired, TypedDict

from ray_jobs.config import Config


class Determinism(TypedDict):
    """What :func:`setup_determinism` sets: torch's algorithm switch, environment variables, and on CUDA cuDNN's."""

    deterministic_algorithms: bool
    env: dict[str, str]
    cudnn_deterministic: NotRequired[bool]
    cudnn_benchmark: NotRequired[bool]


def determinism_settings(deterministic: bool, device_type: str) -> Determinism:
    """What :func:`setup_determinism` sets for ``train.deterministic`` on a ``device_type`` ("cuda" or "cpu")."""
    out: Determinism = {"deterministic_algorithms": deterministic, "env": {}}
    if device_type == "cuda":
        # cuBLAS picks its reduction workspace per stream unless told a fixed one; read at its first call.
        out["env"] = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if deterministic else {}
        out["cudnn_deterministic"], out["cudnn_benchmark"] = deterministic, not deterministic
    return out


def setup_determinism(cfg: Config, device) -> None:
    """Same seed + same world size = same weights: fixed seeds and thread count; with ``train.deterministic`` also
    deterministic kernels (else the fastest ones: autotuned cuDNN). Runs before the model touches the device."""
    import random

    import numpy as np
    import torch

    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    settings = determinism_settings(cfg.train.deterministic, device.type)
    for key, value in settings["env"].items():
        os.environ.setdefault(key, value)  # a value the user set (e.g. ":16:8", also deterministic) is kept
    torch.use_deterministic_algorithms(settings["deterministic_algorithms"])
    if "cudnn_benchmark" in settings:
        torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
