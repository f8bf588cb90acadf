"""Dynamic FP8 activation quantisation: per token, per group of 128 columns.

Block-scaled FP8 GEMMs (DeepSeek-V3's W8A8 scheme) multiply e4m3 activations by
e4m3 weights; the activation scale must be constant over each K block of the
weight scales, so a row is quantised in groups of the weight block's width: each
group's absolute maximum maps onto the largest e4m3 value (448) and its float32
scale ``amax / 448`` is kept, ``x ~= q * scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100.kernels.common import divisibility_attrs
from powertrain_cuda_sm100.support import interpreting

#: The column group one scale covers; equals the weight block width it pairs with.
GROUP = 128
#: Largest finite e4m3fn value.
FP8_MAX = tl.constexpr(448.0)
#: Lower bound of a scale, so an all-zero group quantises to zeros instead of NaN.
MIN_SCALE = tl.constexpr(1e-10)
FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """Float32 ``x`` (already within +-448) cast to e4m3, rounding to nearest.

    Compiled, that is the hardware conversion. The interpreter (triton 3.9) truncates
    the mantissa on this cast and mishandles the carry when it rounds (measured: 126
    became 64), so with ``EMULATE`` the value is first rounded onto the e4m3 grid in
    float32 (3 mantissa bits, quantum fixed at 2^-9 below 2^-6), which the cast then
    keeps exactly, ties to even as on the GPU.
    """
    if EMULATE:
        exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        steps = x / quantum
        nearest = tl.floor(steps + 0.5)
        odd = (nearest - 2.0 * tl.floor(nearest * 0.5)) != 0.0
        x = tl.where(((nearest - steps) == 0.5) & odd, nearest - 1.0, nearest) * quantum
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_groups_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    rows,
    cols,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows x one column group."""
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = group * GROUP + tl.arange(0, GROUP)
    row_ok = offs_m < rows
    mask = row_ok[:, None] & (offs_c < cols)[None, :]
    m64 = offs_m.to(tl.int64)
    x = tl.load(x_ptr + m64[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX, MIN_SCALE)
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + m64[:, None] * stride_qm + offs_c[None, :], to_e4m3(q, EMULATE_CAST), mask=mask)
    tl.store(scale_ptr + m64 * stride_sm + group, scale, mask=row_ok)


#: Rows per program: 32 rows x 128 columns keeps each program's tile small.
BLOCK_M = 32
NUM_WARPS = 4


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, cols]`` -> (e4m3 ``[rows, cols]``, float32 scales ``[rows, ceil(cols / 128)]``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    groups = triton.cdiv(cols, GROUP)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows and cols:
        grid = (triton.cdiv(rows, BLOCK_M), groups)
        quantize_groups_kernel[grid](
            x, q, scales, rows, cols, x.stride(0), q.stride(0), scales.stride(0), GROUP=GROUP, BLOCK_M=BLOCK_M,
            EMULATE_CAST=interpreting(),             num_warps=NUM_WARPS,
        )  # fmt: skip
    return q, scales


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """The quantiser as the launcher compiles it, for bf16 and fp16 activations."""
    specs = []
    for name, pointer in (("bf16", "*bf16"), ("fp16", "*fp16")):
        specs.append(
            {
                "name": f"quantize_groups_{name}",
                "fn": quantize_groups_kernel,
                "signature": (
                    signature := {
                        "x_ptr": pointer,
                        "q_ptr": "*fp8e4nv",
                        "scale_ptr": "*fp32",
                        "rows": "i32",
                        "cols": "i32",
                        "stride_xm": "i32",
                        "stride_qm": "i32",
                        "stride_sm": "i32",
                        "GROUP": "constexpr",
                        "BLOCK_M": "constexpr",
                        "EMULATE_CAST": "constexpr",
                    }
                ),
                "constexprs": {"GROUP": GROUP, "BLOCK_M": BLOCK_M, "EMULATE_CAST": False},
                "attrs": divisibility_attrs(quantize_groups_kernel, signature, ("cols", "stride_xm", "stride_qm")),
                "options": {"num_warps": NUM_WARPS, "num_stages": 1},
            }
        )
    return specs
