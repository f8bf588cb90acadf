"""The kernels run here on the CPU through the Triton interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a kernels module is
first imported; the plugin never imports them before a factory runs, so setting it
here (at collection, before any test) puts every kernel of this session in the
interpreter. Ahead-of-time compilation for GPU targets runs in a subprocess without
it (test_aot.py).
"""

from __future__ import annotations

import os

import pytest

from powertrain.components import Availability, PlatformInfo

os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = ["powertrain.testing"]

#: No NVIDIA GPU exists on the CI machine: the suites run the real kernels under the
#: Triton interpreter on CPU tensors, presented as a CUDA platform of capability 10.0.
INTERPRETER_PLATFORM = PlatformInfo(
    name="cuda",
    device_type="cpu",
    availability=Availability.yes("Triton interpreter (TRITON_INTERPRET=1): kernels run on the CPU"),
    device_count=1,
    device_name="Triton interpreter",
    capability=(10, 0),
    dist_backend="gloo",
)


@pytest.fixture
def interpreter_platform() -> PlatformInfo:
    return INTERPRETER_PLATFORM
