"""The builtin MoE backend, registered like any plugin: ``torch-grouped``.

Importing this module stays cheap: the implementation is imported by the factory,
when assembly (or the conformance kit) actually builds a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain import hookimpl
from powertrain.components import MoEBackendRecord

if TYPE_CHECKING:
    from powertrain.builtin.grouped_moe import TorchGroupedMoE
    from powertrain.interfaces import MoEBackendContext

POWERTRAIN_HOOK_API = 1


def build_grouped(context: MoEBackendContext) -> TorchGroupedMoE:
    from powertrain.builtin.grouped_moe import TorchGroupedMoE

    # Weights and inputs carry their own device; the model dtype is what quantised
    # activations are dequantized to.
    return TorchGroupedMoE(dtype=context.dtype)


@hookimpl
def powertrain_moe_backends() -> list[MoEBackendRecord]:
    return [
        MoEBackendRecord(
            name="torch-grouped",
            platforms={"cpu", "cuda"},
            capabilities={"fp32", "bf16", "fp16", "fp8-block", "fp4", "swiglu-limit"},
            priority=0,
            factory=build_grouped,
            description=(
                "plain-torch MoE: one matmul per active expert over its grouped tokens; FP8/FP4 dequantized on use"
            ),
        )
    ]
