"""Where the backends get their operators: torch_npu's, or (in tests) stand-ins.

Every backend takes an ``ops`` object whose attributes are named and called exactly
like torch_npu's (``ops.npu_fused_infer_attention_score(...)``, ...). On an Ascend
machine that object is the ``torch_npu`` module itself; tests without an NPU pass
torch implementations written from the documented semantics (the test doubles in
``powertrain_cann_ascend.testing.standins``, never used for serving), so everything
around the operators — argument mapping, cache layout, fallbacks — runs for real.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def npu_ops() -> ModuleType:
    """The ``torch_npu`` module (imported here, at backend build, never at plugin import)."""
    return importlib.import_module("torch_npu")
