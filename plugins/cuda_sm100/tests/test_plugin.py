"""Registration and availability: the pack loads anywhere and says where it runs."""

from __future__ import annotations

import pytest

from powertrain.components import Availability, PlatformInfo
from powertrain.testing import PluginContract
from powertrain_cuda_sm100 import support


class TestContract(PluginContract):
    plugin = "cuda_sm100"


def _cuda(capability: tuple[int, int] | None, name: str = "NVIDIA test GPU") -> PlatformInfo:
    return PlatformInfo(
        name="cuda",
        device_type="cuda",
        availability=Availability.yes("1 x test"),
        device_count=1,
        device_name=name,
        capability=capability,
    )


@pytest.mark.parametrize(
    ("capability", "available", "words"),
    [
        ((10, 0), True, "tuned"),
        ((12, 0), True, "tuned"),
        ((9, 0), True, "runs"),
        ((8, 9), False, ">= 9.0"),
        ((7, 5), False, "compute capability 7.5"),
        (None, False, "no CUDA compute capability"),
    ],
)
def test_availability_by_compute_capability(capability: tuple[int, int] | None, available: bool, words: str) -> None:
    result = support.availability(_cuda(capability, "NVIDIA L4"))
    assert result.available is available
    assert words in result.reason


def test_unavailable_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "_triton_installed", lambda: False)
    result = support.availability(_cuda((10, 0)))
    assert not result.available
    assert "triton is not installed" in result.reason


def test_records_declare_the_cuda_platform_and_the_check(powertrain_plugins) -> None:  # noqa: ANN001
    for kind in ("attention", "moe"):
        (provided,) = [p for p in powertrain_plugins.records(kind) if p.record.name == "triton-sm100"]
        assert provided.record.platforms == {"cuda"}
        # Through the record: a Hopper GPU passes, an Ampere one is refused with the reason.
        assert provided.record.availability(_cuda((9, 0))).available
        refused = provided.record.availability(_cuda((8, 0)))
        assert not refused.available and "8.0" in refused.reason
