"""RMSNorm, with the residual add before it fused in: one read of x (and the residual),
one write of the normed row (and the sum), a row per program.

Rounding follows ``powertrain.layers.norm.RMSNorm`` (HF): the sum is rounded to the
activation dtype, statistics are float32, the normed row is cast back before the
weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x,  # [rows, n], row stride given
    residual,  # [rows, n] or unread
    weight,  # [n]
    out,  # [rows, n], contiguous
    summed,  # [rows, n], contiguous, or unread
    stride_x,
    stride_r,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < n
    values = tl.load(x + row * stride_x + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        values = values.to(tl.float32) + tl.load(residual + row * stride_r + cols, mask=inside, other=0.0).to(
            tl.float32
        )
        values = values.to(summed.dtype.element_ty)
        tl.store(summed + row * n + cols, values, mask=inside)
    x32 = values.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(out.dtype.element_ty)
    scaled = normed.to(tl.float32) * tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * n + cols, scaled.to(out.dtype.element_ty), mask=inside)


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm`` of ``x`` [..., n]; with ``residual``: ``(norm(x + residual), x + residual)``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    rows_x = x.reshape(-1, n)
    if rows_x.stride(-1) != 1:
        rows_x = rows_x.contiguous()
    out = torch.empty(rows_x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    rows_r = residual.reshape(-1, n) if residual is not None else rows_x
    if rows_r.stride(-1) != 1:
        rows_r = rows_r.contiguous()
    block = triton.next_power_of_2(n)
    if rows_x.shape[0]:
        rms_norm_kernel[(rows_x.shape[0],)](
            rows_x,
            rows_r,
            weight.contiguous(),
            out,
            summed,
            rows_x.stride(0),
            rows_r.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=block,
            num_warps=_warps(block),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), summed.view(x.shape)


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """The fused add + norm for a bf16 model of hidden size 7168 (DeepSeek-V3) and 4096."""
    del capability
    specs = []
    for hidden in (4096, 7168):
        block = triton.next_power_of_2(hidden)
        specs.append(
            {
                "name": f"rms_norm_residual_{hidden}",
                "fn": rms_norm_kernel,
                "signature": {
                    "x": "*bf16",
                    "residual": "*bf16",
                    "weight": "*bf16",
                    "out": "*bf16",
                    "summed": "*bf16",
                    "stride_x": "i32",
                    "stride_r": "i32",
                    "n": "i32",
                    "eps": "fp32",
                    "HAS_RESIDUAL": "constexpr",
                    "BLOCK_N": "constexpr",
                },
                "constexprs": {"HAS_RESIDUAL": True, "BLOCK_N": block},
                "options": {"num_warps": _warps(block), "num_stages": 1},
            }
        )
    return specs
