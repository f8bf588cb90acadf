"""Platform detection. This machine has no GPU, so the GPU-present path mocks torch.cuda
(the one thing that cannot exist here) and checks everything detect_cuda derives from it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from powertrain.builtin.platforms import detect_cpu, detect_cuda


def test_cpu_is_available_with_real_numbers() -> None:
    info = detect_cpu()
    assert info.available and info.device_type == "cpu" and info.dist_backend == "gloo"
    assert info.total_memory_bytes > 2**30
    assert info.availability.reason.startswith(f"{os.cpu_count()} cores, {info.host_cpus} usable")
    assert 1 <= info.host_cpus <= os.cpu_count()


def test_cuda_without_a_gpu_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the next test covers this path")
    info = detect_cuda()
    assert not info.available
    assert info.availability.reason in (
        "no CUDA device visible to torch",
        "no CUDA device visible to torch (CUDA_VISIBLE_DEVICES is empty)",
        f"torch {torch.__version__} was built without CUDA",
    ) or info.availability.reason.startswith("CUDA runtime error")


def test_cuda_with_a_gpu_reports_capability_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(name="NVIDIA B200", major=10, minor=0, total_memory=180 * 2**30)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    info = detect_cuda()
    assert info.available and info.availability.reason == "8 x NVIDIA B200"
    assert (info.capability, info.device_count, info.total_memory_bytes) == ((10, 0), 8, 180 * 2**30)
    assert info.dist_backend == "nccl"


def test_cuda_driver_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> int:
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    info = detect_cuda()
    assert not info.available
    assert info.availability.reason == "CUDA runtime error: Found no NVIDIA driver on your system"
