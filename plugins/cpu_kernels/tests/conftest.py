from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from powertrain.testing.base import fresh_seed
from powertrain_cpu_kernels import _native

# The conformance kit is a pytest plugin; plugin packages enable it here.
pytest_plugins = ["powertrain.testing"]


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (never a fixed one), torch's global generator seeded with it,
    and printed so a failure can be replayed."""
    value = fresh_seed()
    torch.manual_seed(value)
    print(f"seed={value}")
    return value


@pytest.fixture(params=["avx2+fma", "scalar"])
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test on the AVX2+FMA path (where this CPU has it) and on the forced scalar path."""
    path = request.param
    if path != "scalar" and _native.best_kernel_path() != path:
        # Absent CPU features are detected, never assumed: that path cannot run here.
        pytest.skip(f"this CPU has no {path} (the kernels detected {_native.best_kernel_path()})")
    _native.force_scalar(path == "scalar")
    assert _native.kernel_path() == path
    yield path
    _native.force_scalar(False)
