"""The fused small kernels (RMSNorm + residual, rotary + cache write) under the Triton
interpreter, against the torch layers they replace. The conformance kit covers them
again through the attention backend (test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from powertrain.layers.norm import RMSNorm
from powertrain.layers.rotary import apply_rotary
from powertrain.testing.base import fresh_seed, generator

# bf16: a few ulps (the interpreter truncates each float32 -> bfloat16 cast); the kit uses the same.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture
def gen() -> torch.Generator:
    seed = fresh_seed()
    print(f"seed={seed}")
    return generator(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool, gen: torch.Generator) -> None:
    from powertrain_cuda_sm100.kernels.rmsnorm import rms_norm

    tokens = int(torch.randint(1, 9, (1,), generator=gen))
    # A strided x (a column slice of a wider tensor), as a fused projection hands over.
    wide = torch.randn(tokens, hidden + 8, generator=gen).to(dtype)
    x = wide[:, 3 : 3 + hidden]
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype) if with_residual else None
    norm = RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen).to(dtype))
        want = norm(x, residual)
    got = rms_norm(x, norm.weight.detach(), norm.eps, residual)
    atol, rtol = TOLERANCE[dtype]
    if residual is None:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    else:
        # The sum is rounded to the dtype alike; the interpreter's float32 -> bfloat16 casts
        # truncate instead of rounding to nearest (GPUs round), so allow one bf16 ulp there.
        exact = (0.0, 0.0) if dtype == torch.float32 else (0.0, 2**-7)
        torch.testing.assert_close(got[1], want[1], atol=exact[0], rtol=exact[1])
        torch.testing.assert_close(got[0], want[0], atol=atol, rtol=rtol)
    # And against float64 arithmetic directly (no intermediate rounding) in float32.
    if dtype == torch.float32:
        s = x.double() + (residual.double() if residual is not None else 0)
        want64 = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
        normed = got[0] if residual is not None else got
        torch.testing.assert_close(normed.double(), want64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [32, 16, 0], ids=["full", "partial", "none"])
def test_rotary_cache_write(dtype: torch.dtype, rotary_dim: int, gen: torch.Generator) -> None:
    from powertrain_cuda_sm100.kernels.cache_write import rotary_cache_write

    tokens, heads, kv_heads, head_size, block_size, blocks = 7, 4, 2, 32, 4, 6
    # q, k, v as views of one fused projection, as the Llama layer makes them.
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    q, k, v = fused.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    q, k, v = q.view(tokens, heads, head_size), k.view(tokens, kv_heads, head_size), v.view(tokens, kv_heads, -1)
    angles = torch.rand(tokens, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # Random distinct slots, the last token padding (-1: not written).
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[-1] = -1
    caches = [torch.randn(blocks, block_size, kv_heads, head_size, generator=gen).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]

    atol, rtol = TOLERANCE[dtype]
    if rotary_dim:
        rotated_q = rotary_cache_write(q, k, v, *caches, slots, cos, sin)
        want_k = apply_rotary(k, cos, sin)
        torch.testing.assert_close(rotated_q, apply_rotary(q, cos, sin), atol=atol, rtol=rtol)
    else:  # the plain cache store: no query, nothing returned
        assert rotary_cache_write(None, k, v, *caches, slots) is None
        want_k = k
    written = slots >= 0
    for cache, old, new in zip(caches, before, (want_k, v), strict=True):
        flat, old_flat = cache.view(-1, kv_heads, head_size), old.view(-1, kv_heads, head_size)
        torch.testing.assert_close(flat[slots[written]], new[written], atol=atol, rtol=rtol)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[written]] = False
        assert torch.equal(flat[untouched], old_flat[untouched]), "slots outside slot_mapping changed"
