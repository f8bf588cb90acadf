"""Projection layers whose weights can be packed once for oneDNN on a CPU.

torch's float32 ``F.linear`` calls MKL's sgemm, which runs well below the CPU's
peak where MKL does not tune for the processor (AMD) and on the thin matrices of
decode steps; bfloat16 already goes through oneDNN but reorders the weight on
every call. oneDNN with a weight reordered once at load (what torch.compile's CPU
freezing does) avoids both. Measured on a 2-core AMD EPYC, float32, a 1536x576
weight: 64 rows 0.60 ms -> 0.26 ms, 2048 rows 17.1 ms -> 7.3 ms; the 49152x576
SmolLM2 head at 4 rows 12.6 ms -> 2.5 ms. Elsewhere (Intel, small decode matrices)
MKL can win, so ``pack_for_platform`` packs a weight only where timing its shape on
this machine says so (``linear_choice``). Results agree with ``F.linear`` to float32
rounding (a different summation order), not bit for bit.

With ``[engine] batch_invariant`` nothing is packed and every ``Linear`` multiplies in
whole ``ROW_TILE``-row tiles (``tiled_matmul``): a CPU gemm's rounding follows its row
count (MKL's float32 sgemm gives other bits for 1, 2 and 5 rows of the same weight), a
batched matmul of fixed tiles gives each row the same arithmetic in any batch.

Whether a dtype is packed is the platform's fact (``PlatformInfo.packed_linear_dtypes``,
which the CPU platform derives from what this CPU can run): bfloat16 packing, for one,
needs CPU features that many CPUs lack, and torch refuses it there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from powertrain.layers import linear_choice
from powertrain.layers.linear_choice import PACKED, shape_label

if TYPE_CHECKING:
    from powertrain.components import PlatformInfo
    from powertrain.interfaces import QuantizedLinearKernel, QuantizedWeight
    from powertrain.layers.linear_choice import ShapeTimer

log = structlog.get_logger(__name__)


#: Rows per matmul tile in a batch-invariant engine (a multiple of the CPU gemm kernels' row blocks).
ROW_TILE = 16


def tiled_matmul(x: torch.Tensor, weight_t: torch.Tensor, tile: int | None) -> torch.Tensor:
    """``x @ weight_t`` for ``x`` ``[rows, K]``, ``weight_t`` ``[K, N]``; with ``tile``, as a
    batched matmul of zero-padded ``tile``-row tiles, so no row's arithmetic depends on
    how many rows there are (the weight is broadcast, not copied)."""
    if tile is None:
        return x @ weight_t
    rows = x.shape[0]
    tiles = F.pad(x, (0, 0, 0, -rows % tile)).view(-1, tile, x.shape[1])
    return torch.bmm(tiles, weight_t.expand(tiles.shape[0], -1, -1)).view(-1, weight_t.shape[1])[:rows]


def make_batch_invariant(model: nn.Module, tile: int = ROW_TILE) -> int:
    """Switch every module of ``model`` that multiplies by rows (a ``row_tile`` attribute:
    ``Linear``, the MoE router, MLA's absorbed projections) to ``tile``-row tiles; returns
    how many were switched."""
    modules = [module for module in model.modules() if hasattr(module, "row_tile")]
    for module in modules:
        module.row_tile = tile
    return len(modules)


def onednn_packing_ops() -> bool:
    """Whether this torch build has oneDNN's linear packing ops at all (any CPU, any dtype)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    """``nn.Linear`` that ``pack`` can switch to a oneDNN-packed weight, and
    ``use_quantized`` to a weight kept quantised.

    Models use it for projections that are only ever applied, never read as matrices
    (a layer whose weight is also read directly, like an absorbed MLA projection, stays
    an ``nn.Linear``). After packing or quantising, ``weight`` is None: the other copy has
    an opaque layout, and keeping the dense one as well would defeat it (unless another
    module shares it, e.g. a tied embedding).
    """

    packed: torch.Tensor | None = None
    #: Rows per matmul tile (``make_batch_invariant``); None: one matmul of all rows.
    row_tile: int | None = None
    #: ``kernel.prepare(weight)`` of a weight kept quantised, and its kernel.
    quantized: Any = None
    kernel: QuantizedLinearKernel | None = None

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None

    def use_quantized(self, weight: QuantizedWeight, kernel: QuantizedLinearKernel) -> None:
        """Multiply by ``weight`` as stored, through ``kernel``, from now on."""
        expected = (self.out_features, self.in_features)
        if weight.shape != expected:
            raise ValueError(f"a quantised weight of shape {list(weight.shape)} for a {list(expected)} linear")
        if weight.format not in kernel.formats:
            raise ValueError(
                f"the quantised-linear kernel multiplies {sorted(kernel.formats)}, not {weight.format!r} "
                f"(from {weight.source}); choose another [components] quantized_linear or dequantize"
            )
        self.quantized, self.kernel = kernel.prepare(weight), kernel
        self.weight = None

    @property
    def dense(self) -> bool:
        """Whether the weight is a plain matrix (neither packed nor quantised)."""
        return self.packed is None and self.kernel is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.linear(x, self.quantized, self.bias)
        if self.packed is None:
            if self.row_tile is None:
                return super().forward(x)
            out = tiled_matmul(x.reshape(-1, x.shape[-1]), self.weight.t(), self.row_tile)
            out = out if self.bias is None else out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Pack every ``Linear`` of ``model`` (call once its weights are loaded, on the CPU);
    returns how many were packed."""
    layers = [module for module in model.modules() if isinstance(module, Linear) and module.dense]
    for layer in layers:
        layer.pack()
    return len(layers)


def pack_for_platform(
    model: nn.Module, platform: PlatformInfo, dtype: torch.dtype, timer: ShapeTimer | None = None
) -> int:
    """Pack ``model``'s linears whose weight shape runs faster packed on this CPU (timed
    once per machine by ``linear_choice``, with ``timer`` if given); returns how many were packed.

    Where ``platform`` cannot pack ``dtype`` they all stay plain ``F.linear``, and where it
    packs other dtypes one info line says why not this one (a bfloat16 model on a CPU
    without bfloat16 kernels).
    """
    if dtype in platform.packed_linear_dtypes:
        layers = [module for module in model.modules() if isinstance(module, Linear) and module.dense]
        if not layers:
            return 0
        choice = linear_choice.choose(
            {(layer.out_features, layer.in_features) for layer in layers}, dtype, platform.device_name, timer
        )
        packed = [layer for layer in layers if choice.shapes[layer.out_features, layer.in_features] == PACKED]
        for layer in packed:
            layer.pack()
        log.info(
            "linear implementation chosen",
            dtype=str(dtype),
            shapes={shape_label(shape): candidate for shape, candidate in choice.shapes.items()},
            packed_layers=len(packed),
            plain_layers=len(layers) - len(packed),
            ms=choice.ms,
            measured=choice.measured,
            cache=str(choice.cache),
        )
        return len(packed)
    if platform.linear_packing_note:
        log.info(
            "linear weights not packed: plain F.linear",
            platform=platform.name,
            dtype=str(dtype),
            packed_dtypes=sorted(str(d) for d in platform.packed_linear_dtypes),
            why=platform.linear_packing_note,
        )
    return 0
