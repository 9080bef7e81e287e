"""What the runtime does to the process for GPUs and determinism, tested without a GPU: the settings per device,
the collective's tensor on the runtime's device (NCCL reduces only CUDA tensors), the CUDA device bound for NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ray_jobs.config import load_config
from ray_jobs.train.determinism import determinism_settings, setup_determinism
from ray_jobs.train.runtime import RayRuntime, bind_device
from tests.conftest import ROOT, tiny_overrides


@pytest.mark.parametrize(
    ("deterministic", "device", "expected"),
    [
        (True, "cuda", {"deterministic_algorithms": True, "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
                        "cudnn_deterministic": True, "cudnn_benchmark": False}),
        (False, "cuda", {"deterministic_algorithms": False, "env": {},
                         "cudnn_deterministic": False, "cudnn_benchmark": True}),
        (True, "cpu", {"deterministic_algorithms": True, "env": {}}),
        (False, "cpu", {"deterministic_algorithms": False, "env": {}}),
    ],
)  # fmt: skip
def test_determinism_settings_per_device(deterministic: bool, device: str, expected: dict) -> None:
    assert determinism_settings(deterministic, device) == expected


def test_setup_determinism_switches_deterministic_algorithms(tmp_path) -> None:
    def cfg(deterministic: bool):
        overrides = [*tiny_overrides(tmp_path), f"train.deterministic={str(deterministic).lower()}"]
        return load_config(ROOT / "configs" / "demo.yaml", overrides)

    try:
        setup_determinism(cfg(False), torch.device("cpu"))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        setup_determinism(cfg(True), torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled()


def _ray_runtime(device: torch.device, world_size: int) -> RayRuntime:
    """A RayRuntime as a worker would hold it, without a Ray train context."""
    rt = RayRuntime.__new__(RayRuntime)
    rt.rank, rt.world_size, rt._device = 0, world_size, device
    return rt


def test_all_reduce_sum_hands_the_collective_a_tensor_on_the_runtime_device(monkeypatch) -> None:
    seen = []

    class Reduced(Exception):
        """Stops after the call: a meta tensor (our stand-in for a CUDA one) has no values to read back."""

    def fake_all_reduce(t):
        seen.append((t.device, t.dtype))
        raise Reduced

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    with pytest.raises(Reduced):
        _ray_runtime(torch.device("meta"), 2).all_reduce_sum([1.0, 2.0])
    assert seen == [(torch.device("meta"), torch.float64)]


def test_all_reduce_sum_on_a_gloo_group_of_one(tmp_path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        # The runtime is told it has 2 ranks so it takes the collective path; the group of one sums its own values.
        assert _ray_runtime(torch.device("cpu"), 2).all_reduce_sum([1.5, 2.0, 0.0]) == [1.5, 2.0, 0.0]
    finally:
        dist.destroy_process_group()


def test_a_cuda_device_is_bound_as_the_current_device_and_cpu_is_left_alone(monkeypatch) -> None:
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert bind_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert bind_device(torch.device("cpu")) == torch.device("cpu")
    assert bound == [torch.device("cuda", 1)]
