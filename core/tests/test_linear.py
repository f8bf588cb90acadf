"""oneDNN-packed projections (layers/linear.py) against a float64 torch oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from powertrain.layers.linear import Linear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN linear packing"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_packed_linear_matches_float64(dtype: torch.dtype, bias: bool, rows: int) -> None:
    seed = torch.seed()
    layer = Linear(192, 320, bias=bias, dtype=dtype)
    x = torch.randn(rows, 192, dtype=dtype)
    oracle = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    plain = layer(x)
    layer.pack()
    packed = layer(x)
    assert layer.weight is None and packed.dtype == dtype and packed.shape == (rows, 320)
    # Each output sums 192 products: allow a few roundings of the output's magnitude.
    tolerance = 4 * 192**0.5 * torch.finfo(dtype).eps * oracle.abs().max().item()
    assert (packed.double() - oracle).abs().max().item() < tolerance, f"seed={seed}"
    assert (plain.double() - oracle).abs().max().item() < tolerance, f"seed={seed}"


def test_packed_linear_takes_leading_dims_and_strided_inputs() -> None:
    layer = Linear(64, 96)
    fused = torch.randn(3, 7, 200)
    x = fused[..., 10:74]  # a strided view, as a split of a fused projection gives
    expected = layer(x)
    layer.pack()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_packs_only_powertrain_linears_and_keeps_shared_weights() -> None:
    embedding = nn.Embedding(50, 32)
    head = Linear(32, 50, bias=False)
    head.weight = embedding.weight  # tied, as a model with tie_word_embeddings does
    plain = nn.Linear(32, 32)  # read as a matrix elsewhere: must stay dense
    model = nn.ModuleDict({"embedding": embedding, "head": head, "plain": plain, "o": Linear(32, 32)})
    hidden = torch.randn(4, 32)
    expected = hidden @ embedding.weight.T

    assert pack_linears(model) == 2
    assert pack_linears(model) == 0  # already packed
    assert isinstance(embedding.weight, nn.Parameter) and plain.weight is not None
    torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding(torch.tensor([3])), embedding.weight[3:4])


def test_can_pack_is_cpu_float_only() -> None:
    assert can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)
