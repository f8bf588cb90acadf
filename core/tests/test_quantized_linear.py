"""The builtin quantised-linear reference, the QuantizedWeight contract and the Linear /
Embedding layers that hold weights kept quantised."""

from __future__ import annotations

import pytest
import torch

from powertrain.builtin.quantized_linear import DequantizingLinear
from powertrain.interfaces import QuantizedWeight
from powertrain.layers.embedding import Embedding
from powertrain.layers.linear import Linear, pack_linears
from powertrain.testing import QuantizedLinearSuite
from powertrain.testing.base import generator
from powertrain.testing.quantized_linear import random_quantized_weight


class TestTorchDequantize(QuantizedLinearSuite):
    component = "torch-dequantize"


def test_widening_and_stacking_are_lossless(seed: int) -> None:
    gen = generator(seed)
    q4 = random_quantized_weight(gen, 5, 64, "q4", 32, True)
    q8 = random_quantized_weight(gen, 3, 64, "q8", 16, False)
    assert torch.equal(q4.widened(16).dequantize(), q4.dequantize())
    stacked = QuantizedWeight.stack_rows([q4, q8, q4.select_rows(slice(1, 3))])
    assert (stacked.format, stacked.group, stacked.shape) == ("q8", 16, (10, 64))
    want = torch.cat([q4.dequantize(), q8.dequantize(), q4.dequantize()[1:3]])
    assert torch.equal(stacked.dequantize(), want)


def test_q4_nibble_order_is_ggml_s() -> None:
    """Byte j of a 32-column group holds column j (low nibble) and column j + 16 (high)."""
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 3] = 0x5A  # column 3 = 0xA, column 19 = 0x5
    weight = QuantizedWeight(codes, torch.ones(1, 1), None, "q4", 32)
    dense = weight.dequantize()[0]
    assert dense[3] == 10 and dense[19] == 5 and dense.sum() == 15


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(group=16), "group 16"),
        (dict(scales=torch.ones(2, 3)), "scales must be float32 \\[2, 2\\]"),
        (dict(codes=torch.zeros(2, 32, dtype=torch.int8)), "codes must be 2-d torch.uint8"),
    ],
)
def test_invalid_weights_are_refused(change: dict, message: str) -> None:
    fields = dict(
        codes=torch.zeros(2, 32, dtype=torch.uint8), scales=torch.ones(2, 2), offsets=None, format="q4", group=32
    )
    with pytest.raises(ValueError, match=message):
        QuantizedWeight(**{**fields, **change}, source="Q4_0")


def test_linear_and_embedding_layers_use_the_kept_weight(seed: int) -> None:
    gen = generator(seed)
    weight = random_quantized_weight(gen, 48, 64, "q8", 32, True)
    linear = Linear(64, 48, bias=False)
    linear.use_quantized(weight, DequantizingLinear())
    assert linear.weight is None and pack_linears(torch.nn.Sequential(linear)) == 0  # never packed
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(linear(x), x @ weight.dequantize().T)

    embedding = Embedding(48, 64)
    embedding.use_quantized(weight, torch.float32)
    ids = torch.tensor([[5, 0], [47, 5]])
    assert torch.equal(embedding(ids), weight.dequantize()[ids])
    with pytest.raises(ValueError, match="shape \\[48, 64\\] for a \\[64, 48\\]"):
        Linear(48, 64).use_quantized(weight, DequantizingLinear())


class _Checkpoint:
    """What ``kept_quantized`` reads of a checkpoint: the formats its tensors could keep."""

    quantized_formats = frozenset({"q4", "q8"})


@pytest.mark.parametrize(
    ("mode", "kept"),
    [("auto", False), ("keep", True), ("dequantize", False)],
)
def test_quantization_mode_decides_whether_weights_stay_quantised(mode: str, kept: bool) -> None:
    """With only the builtins, ``auto`` dequantises: the reference expands weights per call,
    which is slower than dequantising once. ``keep`` keeps them even so."""
    from powertrain.assemble import plan
    from powertrain.assemble.loading import kept_quantized
    from powertrain.config import EngineConfig
    from powertrain.llm import apply_overrides
    from powertrain.plugins import PluginManager

    config = apply_overrides(EngineConfig(), {"quantization": mode})
    plugins = PluginManager.load(config.plugins, environ={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"})
    kernel = kept_quantized(plan(config, plugins), _Checkpoint(), torch.float32)
    assert isinstance(kernel, DequantizingLinear) if kept else kernel is None


@pytest.mark.parametrize("seed", range(3))
def test_rounding_a_dense_weight_to_q8_moves_it_by_at_most_half_a_step(seed: int) -> None:
    """``QuantizedWeight.q8_of`` (a drafter's weights kept as q8): against the float64 weight,
    every entry within max|w_group| / 254 (half of one code step), codes within [-127, 127],
    each group's largest entry exact up to float32 rounding, and an all-zero group all zero."""
    gen = generator(seed)
    weight = torch.randn(48, 96, generator=gen, dtype=torch.float64) * torch.rand(
        48, 1, generator=gen, dtype=torch.float64
    )
    weight[3, 32:64] = 0.0
    rounded = QuantizedWeight.q8_of(weight.float())
    assert rounded.format == "q8" and rounded.group == 32 and rounded.shape == (48, 96)
    assert int(rounded.codes.abs().max()) <= 127
    step = weight.view(48, 3, 32).abs().amax(dim=-1, keepdim=True) / 127
    error = (rounded.dequantize(torch.float64).view(48, 3, 32) - weight.view(48, 3, 32)).abs()
    assert bool((error <= step / 2 * (1 + 1e-5) + 1e-7).all())
    assert bool((rounded.dequantize()[3, 32:64] == 0).all())
    with pytest.raises(ValueError, match="no whole 32-column groups"):
        QuantizedWeight.q8_of(torch.randn(4, 40))
