"""GGUF block-quantised tensors as QuantizedWeights, against gguf-py's dequantisation (the oracle).

Every comparison is exact: the converter forms the same float32 scale products as gguf-py and
``scale * code + offset`` rounds the same operations (the module docstring says why Q4_0's and
Q5_0's shifted zero points do not round at all).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from powertrain.interfaces.quantized import QuantizedWeight
from powertrain.loader import resolve_model_path
from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError
from powertrain.loader.gguf_quants import KEPT_TYPES, to_quantized_weight
from powertrain.loader.gguf_reader import read_gguf

Q = gguf.GGMLQuantizationType

#: Type -> (format, group, has offsets, byte positions of its float16 scales in a block).
EXPECTED = {
    Q.Q4_0: ("q4", 32, True, (0,)),
    Q.Q4_1: ("q4", 32, True, (0, 2)),
    Q.Q4_K: ("q4", 32, True, (0, 2)),
    Q.Q8_0: ("q8", 32, False, (0,)),
    Q.Q5_0: ("q8", 32, False, (0,)),
    Q.Q5_1: ("q8", 32, True, (0, 2)),
    Q.Q5_K: ("q8", 32, True, (0, 2)),
    Q.Q6_K: ("q8", 16, False, (208,)),
    Q.Q3_K: ("q8", 16, False, (108,)),
    Q.Q2_K: ("q8", 16, True, (80, 82)),
}
#: The kept types gguf-py can also quantize (it has no k-quant quantizers).
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
#: (rows, blocks per row).
SHAPES = [(1, 1), (1, 4), (3, 2), (13, 3)]
TYPES = sorted(EXPECTED, key=lambda kind: kind.name)


def random_blocks(rng: np.random.Generator, kind: Q, rows: int, blocks: int) -> np.ndarray:
    """Random bytes ``[rows, blocks * type_size]`` whose float16 fields are random finite values
    (any sign, subnormals and zeros included, no inf or NaN)."""
    _, type_size = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(rows * blocks, type_size), dtype=np.uint8)
    for start in EXPECTED[kind][3]:
        bits = rng.integers(0, 1 << 16, size=rows * blocks, dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent (inf/NaN) loses its top bit
        data[:, start : start + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks * type_size)


def assert_matches_gguf_py(data: np.ndarray, kind: Q, shape: tuple[int, int]) -> QuantizedWeight:
    expected = gguf.quants.dequantize(data, kind).reshape(shape)
    assert np.isfinite(expected).all()
    weight = to_quantized_weight(data, kind, shape, name="blk.0.test.weight")
    fmt, group, has_offsets, _ = EXPECTED[kind]
    assert (weight.format, weight.group, weight.source, weight.shape) == (fmt, group, kind.name, shape)
    assert (weight.offsets is not None) == has_offsets
    for tensor in (weight.codes, weight.scales, weight.offsets):
        if tensor is not None:
            assert tensor.is_contiguous() and not np.shares_memory(tensor.numpy(), data)
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    return weight


def test_kept_types_are_the_documented_ten() -> None:
    assert frozenset(EXPECTED) == KEPT_TYPES


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize(("rows", "blocks"), SHAPES, ids=lambda value: str(value))
def test_random_blocks_convert_exactly(kind: Q, rows: int, blocks: int, seed: int) -> None:
    data = random_blocks(np.random.default_rng(seed), kind, rows, blocks)
    data.setflags(write=False)  # as the memory-mapped file is
    assert_matches_gguf_py(data, kind, (rows, blocks * GGML_QUANT_SIZES[kind][0]))


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda kind: kind.name)
def test_gguf_py_quantized_floats_convert_exactly(kind: Q, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((9, 4 * 32)).astype(np.float32) * rng.lognormal(0, 2, size=(9, 1)).astype(np.float32)
    values[0] = 0  # an all-zero row quantizes to zero scales
    values[1, :32] += 10  # a block far from zero (Q4_1's and Q5_1's minimum)
    assert_matches_gguf_py(gguf.quants.quantize(values, kind), kind, values.shape)


def test_any_array_shape_holding_the_bytes_is_accepted(seed: int) -> None:
    data = random_blocks(np.random.default_rng(seed), Q.Q6_K, 4, 2)
    flat = to_quantized_weight(data.reshape(-1), Q.Q6_K, (4, 512), name="w")
    assert torch.equal(flat.dequantize(), to_quantized_weight(data, Q.Q6_K, (4, 512), name="w").dequantize())


def test_embedded_model_tensors_convert_exactly() -> None:
    tensors = {tensor.name: tensor for tensor in read_gguf(resolve_model_path("smollm2-135m").path).tensors}
    chosen = [tensors[name] for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight")]
    chosen += [tensor for tensor in tensors.values() if tensor.tensor_type == Q.Q8_0][:1]
    assert [tensor.tensor_type for tensor in chosen] == [Q.Q4_1, Q.Q4_1, Q.Q8_0]
    for tensor in chosen:
        assert_matches_gguf_py(tensor.data, tensor.tensor_type, tuple(reversed(tensor.shape)))


@pytest.mark.parametrize("kind", [Q.IQ2_XXS, Q.F16, Q.TQ1_0], ids=lambda kind: kind.name)
def test_an_unkept_type_is_refused_with_the_way_out(kind: Q) -> None:
    data = np.zeros((2, 256 // GGML_QUANT_SIZES[kind][0] * GGML_QUANT_SIZES[kind][1]), dtype=np.uint8)
    with pytest.raises(UnsupportedCheckpointError) as raised:
        to_quantized_weight(data, kind, (2, 256), name="blk.3.ffn_up.weight")
    message = str(raised.value)
    assert "'blk.3.ffn_up.weight'" in message and kind.name in message
    assert "Q4_K" in message and 'quantization = "dequantize"' in message


@pytest.mark.parametrize(
    ("data", "shape", "problem"),
    [
        (np.zeros((2, 3 * 18), np.uint8), (2, 3 * 32 + 16), "not a positive multiple of Q4_0's block of 32"),
        (np.zeros((2, 3 * 18), np.uint8), (2, 0), "not a positive multiple"),
        (np.zeros((2, 3 * 18 - 1), np.uint8), (2, 96), "needs 108 bytes (6 blocks of 18)"),
        (np.zeros((3, 3 * 18), np.uint8), (2, 96), "needs 108 bytes"),
        (np.zeros((2, 3 * 18), np.int8), (2, 96), "its data is 108 int8 values"),
    ],
    ids=["columns-not-whole-blocks", "no-columns", "bytes-missing", "bytes-extra", "not-bytes"],
)
def test_bytes_that_do_not_fit_the_shape_are_corrupt(data: np.ndarray, shape: tuple[int, int], problem: str) -> None:
    with pytest.raises(CorruptCheckpointError) as raised:
        to_quantized_weight(data, Q.Q4_0, shape, name="output.weight")
    assert "'output.weight'" in str(raised.value) and problem in str(raised.value)
