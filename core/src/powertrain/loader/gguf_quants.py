"""GGUF block-quantised tensors converted, losslessly, into ``QuantizedWeight``'s two layouts.

ggml stores a quantised row as blocks: a float16 scale (sometimes a minimum) and packed integer
codes. Each converter here unpacks every block of a tensor at once with numpy and returns the
codes in the ``q4`` or ``q8`` layout of ``powertrain.interfaces.quantized`` with float32 per-group
scales and offsets. The layouts of the blocks, and the order of the float32 products, are those of
gguf-py's ``gguf.quants`` dequantisers, so ``to_quantized_weight(...).dequantize()`` equals
``gguf.quants.dequantize`` exactly (a test checks every type):

* a scale is the same float32 product gguf-py forms (``f32(d) * f32(sc)`` for a k-quant), and
  an offset the negation of the product it subtracts, so ``scale * code + offset`` rounds the
  same two operations;
* Q4_0 and Q5_0 subtract their zero point (8, 16) from the code: Q5_0's signed codes fit a byte,
  and Q4_0's offset ``-8 * d`` adds back exactly, because ``d * q`` and ``d * (q - 8)`` need at
  most 15 significant bits (float16's 11 times 4) and float32 holds them without rounding.

Scales are read little-endian, as gguf-py reads them on every machine it runs on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from powertrain.interfaces.quantized import QuantizedWeight
from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

Q = GGMLQuantizationType
_F16 = np.dtype("<f2")
_NIBBLES = np.array([0, 4], dtype=np.uint8)
_CRUMBS = np.array([0, 2, 4, 6], dtype=np.uint8)
_BITS = np.arange(8, dtype=np.uint8)

#: (codes, scales, offsets), each with one leading row per block.
_Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 ``[blocks, 1]``."""
    return blocks[:, start : start + 2].view(_F16).astype(np.float32)


def _low_high(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[..., n]`` as their low nibbles then their high nibbles ``[..., 2, n]``."""
    return (packed[..., None, :] >> _NIBBLES[:, None]) & np.uint8(0x0F)


def _q4_0(blocks: np.ndarray) -> _Parts:
    d = _f16(blocks, 0)
    return blocks[:, 2:].copy(), d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> _Parts:
    return blocks[:, 4:].copy(), _f16(blocks, 0), _f16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> _Parts:
    return blocks[:, 2:].view(np.int8).copy(), _f16(blocks, 0), None


def _five_bit(high_bits: np.ndarray, nibbles: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 ``[blocks, 32]``: a nibble plus bit ``i`` of the little-endian uint32."""
    low = _low_high(nibbles).reshape(-1, 32)
    return low | (np.unpackbits(high_bits, axis=-1, bitorder="little") << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> _Parts:
    codes = _five_bit(blocks[:, 2:6], blocks[:, 6:]).view(np.int8) - np.int8(16)
    return codes, _f16(blocks, 0), None


def _q5_1(blocks: np.ndarray) -> _Parts:
    return _five_bit(blocks[:, 4:8], blocks[:, 8:]).view(np.int8), _f16(blocks, 0), _f16(blocks, 2)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit sub-block scales and minimums, packed in 12 bytes, as float32."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _k_scales_offsets(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mins = _k_scale_min(blocks[:, 4:16])
    return _f16(blocks, 0) * sc, -(_f16(blocks, 2) * mins)


def _q4_k(blocks: np.ndarray) -> _Parts:
    # Each 32 bytes hold two 32-value sub-blocks: byte l has value l of the first in its low nibble
    # and value l of the second in its high one. q4 wants, per sub-block, byte j = values j and j+16.
    qs = blocks[:, 16:].reshape(-1, QK_K // 64, 32)
    first, second = qs[..., :16], qs[..., 16:]
    codes = np.stack(
        [(first & np.uint8(0x0F)) | (second << np.uint8(4)), (first >> np.uint8(4)) | (second & np.uint8(0xF0))],
        axis=-2,
    )
    return codes.reshape(-1, QK_K // 2), *_k_scales_offsets(blocks)


def _q5_k(blocks: np.ndarray) -> _Parts:
    qh = blocks[:, 16:48]
    low = _low_high(blocks[:, 48:].reshape(-1, QK_K // 64, 32)).reshape(-1, QK_K // 32, 32)
    high = (qh[:, None, :] >> _BITS[:, None]) & np.uint8(1)
    codes = (low | (high << np.uint8(4))).view(np.int8)
    return codes.reshape(-1, QK_K), *_k_scales_offsets(blocks)


def _q6_k(blocks: np.ndarray) -> _Parts:
    low = _low_high(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, QK_K // 32, 32)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _CRUMBS[:, None]) & np.uint8(3)
    codes = (low | (high.reshape(-1, QK_K // 32, 32) << np.uint8(4))).view(np.int8) - np.int8(32)
    scales = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return codes.reshape(-1, QK_K), scales, None


def _q3_k(blocks: np.ndarray) -> _Parts:
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    # Sixteen 6-bit scales: low nibbles in bytes 0..7 (low halves first), high crumbs in 8..11.
    low = (packed[:, None, :8] >> _NIBBLES[:, None]).reshape(-1, 16)
    high = (packed[:, None, 8:] >> _CRUMBS[:, None]).reshape(-1, 16)
    sc = ((low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))).view(np.int8) - np.int8(32)
    scales = _f16(blocks, 108) * sc.astype(np.float32)
    # Codes are a 2-bit value minus 4 where its bit in hmask is clear: -4..3.
    ql = (qs.reshape(-1, 2, 1, 32) >> _CRUMBS[:, None]) & np.uint8(3)
    cleared = ((hmask[:, None, :] >> _BITS[:, None]) & np.uint8(1)) ^ np.uint8(1)
    codes = ql.reshape(-1, 8, 32).view(np.int8) - (cleared << np.uint8(2)).view(np.int8)
    return codes.reshape(-1, QK_K), scales, None


def _q2_k(blocks: np.ndarray) -> _Parts:
    packed = blocks[:, :16]
    codes = (blocks[:, 16:80].reshape(-1, 2, 1, 32) >> _CRUMBS[:, None]) & np.uint8(3)
    scales = _f16(blocks, 80) * (packed & np.uint8(0x0F)).astype(np.float32)
    offsets = -(_f16(blocks, 82) * (packed >> np.uint8(4)).astype(np.float32))
    return codes.reshape(-1, QK_K).view(np.int8), scales, offsets


#: Type -> (format, group, converter of ``[blocks, type_size]`` bytes).
_CONVERTERS: dict[GGMLQuantizationType, tuple[str, int, Callable[[np.ndarray], _Parts]]] = {
    Q.Q4_0: ("q4", 32, _q4_0),
    Q.Q4_1: ("q4", 32, _q4_1),
    Q.Q4_K: ("q4", 32, _q4_k),
    Q.Q8_0: ("q8", 32, _q8_0),
    Q.Q5_0: ("q8", 32, _q5_0),
    Q.Q5_1: ("q8", 32, _q5_1),
    Q.Q5_K: ("q8", 32, _q5_k),
    Q.Q6_K: ("q8", 16, _q6_k),
    Q.Q3_K: ("q8", 16, _q3_k),
    Q.Q2_K: ("q8", 16, _q2_k),
}
#: The stored types ``to_quantized_weight`` converts; others are dequantised to float.
KEPT_TYPES: frozenset[GGMLQuantizationType] = frozenset(_CONVERTERS)
#: Kept type -> the ``QuantizedWeight`` format it becomes.
KEPT_FORMATS: dict[GGMLQuantizationType, str] = {kind: fmt for kind, (fmt, _, _) in _CONVERTERS.items()}


def to_quantized_weight(
    data: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int], *, name: str
) -> QuantizedWeight:
    """The ``[rows, cols]`` tensor ``name`` stored as ``ggml_type`` blocks in ``data`` (uint8,
    ``[rows, row_bytes]`` as ``GGUFTensorInfo.data`` gives it; any shape with those bytes in
    order will do), as a ``QuantizedWeight`` with the same values. Nothing returned shares
    memory with ``data``.

    Raises ``UnsupportedCheckpointError`` for a type not in ``KEPT_TYPES`` and
    ``CorruptCheckpointError`` when ``shape`` and the bytes do not fit together.
    """
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in _CONVERTERS:
        kept = ", ".join(sorted(kind.name for kind in KEPT_TYPES))
        raise UnsupportedCheckpointError(
            f"tensor {name!r} is stored as {ggml_type.name}, which powertrain does not keep quantised "
            f"(it keeps {kept}); load the model with its weights dequantised instead: "
            f'[model] quantization = "dequantize"'
        )
    fmt, group, convert = _CONVERTERS[ggml_type]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rows, cols = shape
    if cols <= 0 or cols % block_size:
        raise CorruptCheckpointError(
            f"tensor {name!r} has {cols} columns, not a positive multiple of {ggml_type.name}'s block of {block_size}"
        )
    n_blocks = rows * (cols // block_size)
    if data.dtype != np.uint8 or data.size != n_blocks * type_size:
        raise CorruptCheckpointError(
            f"tensor {name!r} ({ggml_type.name} [{rows}, {cols}]) needs {n_blocks * type_size} bytes "
            f"({n_blocks} blocks of {type_size}), but its data is {data.size} {data.dtype} values"
        )
    codes, scales, offsets = convert(np.ascontiguousarray(data).reshape(n_blocks, type_size))
    width = cols // 2 if fmt == "q4" else cols
    return QuantizedWeight(
        codes=torch.from_numpy(codes.reshape(rows, width)),
        scales=torch.from_numpy(scales.reshape(rows, cols // group)),
        offsets=None if offsets is None else torch.from_numpy(offsets.reshape(rows, cols // group)),
        format=fmt,
        group=group,
        source=ggml_type.name,
    )
