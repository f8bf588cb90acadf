"""Plain-torch stand-ins (test doubles, never for serving) for the torch_npu operators
the pack calls, for machines without an Ascend NPU: the tests (and
``benchmarks/kernels_npu.py --smoke``) hand them to the backends in place of the
``torch_npu`` module, so everything around the operators runs for real.

Each stand-in implements its operator's documented semantics (the docstrings name the
pages followed), only for the argument combinations the pack uses, and validates its
arguments as the documentation states, so a wrong mapping fails loudly. They are not
the operators: what real hardware does differently is not known here.
"""

from __future__ import annotations

from typing import Any

from powertrain_cann_ascend.testing.standins.attention import FusedInferAttentionStandIn
from powertrain_cann_ascend.testing.standins.moe import MoEOpsStandIn
from powertrain_cann_ascend.testing.standins.sparse import SparseAttentionStandIn

__all__ = ["AttentionOpsStandIn", "FusedInferAttentionStandIn", "MoEOpsStandIn", "SparseAttentionStandIn", "StandInOps"]


class AttentionOpsStandIn(FusedInferAttentionStandIn, SparseAttentionStandIn):
    """The operators the attention backend calls, on one object."""

    def __init__(self) -> None:
        FusedInferAttentionStandIn.__init__(self)
        SparseAttentionStandIn.__init__(self)


class StandInOps(AttentionOpsStandIn, MoEOpsStandIn):
    """Every stand-in operator on one object, as the ``torch_npu`` module has them."""

    def __init__(self, group: Any = None, group_name: str | None = None) -> None:
        AttentionOpsStandIn.__init__(self)
        MoEOpsStandIn.__init__(self, group, group_name)
