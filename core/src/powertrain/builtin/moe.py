"""The builtin MoE backends, registered like any plugin: ``torch-grouped`` and its
batch-invariant variant ``torch-grouped-invariant``.

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


#: Rows per matmul tile of ``torch-grouped-invariant``: a multiple of the CPU GEMM kernels' row blocks.
INVARIANT_ROW_TILE = 16


def build_grouped_invariant(context: MoEBackendContext) -> TorchGroupedMoE:
    from powertrain.builtin.grouped_moe import TorchGroupedMoE

    return TorchGroupedMoE(dtype=context.dtype, row_tile=INVARIANT_ROW_TILE)


GROUPED_CAPABILITIES = frozenset({"fp32", "bf16", "fp16", "fp8-block", "fp4", "swiglu-limit"})


@hookimpl
def powertrain_moe_backends() -> list[MoEBackendRecord]:
    return [
        MoEBackendRecord(
            name="torch-grouped",
            platforms={"cpu", "cuda"},
            capabilities=GROUPED_CAPABILITIES,
            priority=0,
            factory=build_grouped,
            description=(
                "plain-torch MoE: one matmul per active expert over its grouped tokens; FP8/FP4 dequantized on use"
            ),
        ),
        MoEBackendRecord(
            name="torch-grouped-invariant",
            platforms={"cpu", "cuda"},
            capabilities=GROUPED_CAPABILITIES | {"batch-invariant"},
            priority=-10,  # chosen by "auto" only where batch invariance is required
            factory=build_grouped_invariant,
            description=(
                f"torch-grouped in whole {INVARIANT_ROW_TILE}-row matmul tiles: a token's output does not "
                "depend on its batch ([engine] batch_invariant)"
            ),
        ),
    ]
