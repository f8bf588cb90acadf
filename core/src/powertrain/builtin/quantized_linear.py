"""The builtin quantised-linear backend, registered like any plugin: ``torch-dequantize``.

It expands the weight to a dense copy in the activations' dtype on every call and hands it to
``F.linear``: correct on every platform and the reference a native kernel is checked against,
but no faster than dequantising once at load (only smaller in memory between calls). So its
record says ``expands_weights`` and ``quantization = "auto"`` does not keep weights for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powertrain import hookimpl
from powertrain.components import QuantizedLinearRecord
from powertrain.interfaces import QuantizedLinearContext, QuantizedWeight

POWERTRAIN_HOOK_API = 1


class DequantizingLinear:
    """``interfaces.QuantizedLinearKernel`` by dequantising per call."""

    formats = frozenset({"q4", "q8"})

    def prepare(self, weight: QuantizedWeight) -> QuantizedWeight:
        return weight

    def linear(self, x: torch.Tensor, prepared: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, prepared.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))


def build_dequantizing(context: QuantizedLinearContext) -> DequantizingLinear:
    return DequantizingLinear()


@hookimpl
def powertrain_quantized_linear_backends() -> list[QuantizedLinearRecord]:
    return [
        QuantizedLinearRecord(
            name="torch-dequantize",
            platforms={"cpu", "cuda"},
            capabilities={"q4", "q8"},
            priority=-10,
            factory=build_dequantizing,
            expands_weights=True,
            description="reference: expands the weight to a dense copy on every call, then F.linear",
        )
    ]
