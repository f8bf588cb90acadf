"""The two grouped GEMMs of a MoE layer, over rows sorted and padded by ``moe_align``.

Each program owns one ``BLOCK_M`` x ``BLOCK_N`` output tile of one M-block, and an
M-block belongs to exactly one expert, so a tile is a plain GEMM against that
expert's weights (``[E, N, K]``, K contiguous: the loader's layout, which is the
K-major B operand both wgmma and tcgen05 read).

* ``gate_up_silu_kernel``: gathers each row's token from the hidden states and
  accumulates the gate rows ``n`` and the up rows ``N + n`` of ``w13`` side by side,
  then writes ``silu(gate) * up``: the ``[rows, 2I]`` intermediate never exists.
  For FP8 experts its epilogue also quantises that activation per row and 128
  columns (one tile is one group), ready for the FP8 down GEMM.
* ``down_kernel``: multiplies by ``w2`` and by each row's routing weight, and writes
  the row to its (token, slot) place. The sum over the top-k slots is
  ``moe_combine``'s, in a fixed order (no atomics): the result is deterministic,
  whatever the launch order, and foreign pairs are skipped there without zeroing
  the per-pair buffer first.

Operands are bf16/fp16 with float32 accumulation, or e4m3 with float32 scales
applied per K block (activation scale per row x weight scale per 128x128 block,
DeepSeek-V3's W8A8 block FP8). ``DOT_F32`` upcasts the dot operands: the Triton
interpreter multiplies half-precision ``tl.dot`` operands wrongly, compiled kernels
keep native tensor-core dtypes.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100.kernels.common import divisibility_attrs
from powertrain_cuda_sm100.kernels.fp8_quant import to_e4m3
from powertrain_cuda_sm100.kernels.moe_align import Alignment
from powertrain_cuda_sm100.support import interpreting

#: Width of an FP8 weight block and of an activation scale group.
QUANT_GROUP = tl.constexpr(128)
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-10)


@triton.jit
def _e2m1(code):
    """The values of 4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit; no bias trick:
    0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), in float32."""
    exponent = ((code >> 1) & 3).to(tl.float32)
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, tl.exp2(exponent - 1.0) * (1.0 + 0.5 * mantissa))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _fp4_tile(w_rows, scale_rows, kb, K, n_ok, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """One K tile of FP4 weight rows (``w_rows``/``scale_rows``: per output column, its
    packed row and its ue8m0 scale row), dequantised to ``DTYPE`` as its even and its odd
    K columns, each ``[BLOCK_K / 2, BLOCK_N]``: a byte holds columns 2j (low nibble) and
    2j + 1, so multiplying even and odd activation columns separately needs no interleave."""
    half = tl.arange(0, BLOCK_K // 2)
    even = kb * BLOCK_K + 2 * half
    ok = (even < K)[:, None] & n_ok[None, :]
    packed = tl.load(w_rows[None, :] + (even // 2)[:, None], mask=ok, other=0).to(tl.int32)
    exponent = tl.load(scale_rows[None, :] + (even // 32)[:, None], mask=ok, other=127).to(tl.float32)
    scale = tl.exp2(exponent - 127.0)
    low = (_e2m1(packed & 15) * scale).to(DTYPE)
    high = (_e2m1(packed >> 4) * scale).to(DTYPE)
    return low, high


@triton.jit
def _fp4_dot(a_rows, row_ok, w_rows, scale_rows, kb, K, n_ok, acc, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc`` plus one K tile of activations (row pointers ``a_rows``) times FP4 weights."""
    half = tl.arange(0, BLOCK_K // 2)
    even = kb * BLOCK_K + 2 * half
    a_mask = row_ok[:, None] & (even < K)[None, :]
    a_even = tl.load(a_rows[:, None] + even[None, :], mask=a_mask, other=0.0)
    a_odd = tl.load(a_rows[:, None] + even[None, :] + 1, mask=a_mask, other=0.0)
    dtype = tl.float32 if DOT_F32 else a_even.dtype
    w_even, w_odd = _fp4_tile(w_rows, scale_rows, kb, K, n_ok, BLOCK_K, dtype)
    acc = tl.dot(a_even.to(dtype), w_even, acc)
    return tl.dot(a_odd.to(dtype), w_odd, acc)


@triton.jit
def _tile_order(pid, num_padded, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, M-blocks grouped by ``GROUP_M`` so neighbouring
    programs share weight tiles in L2; -1 past the rows in use."""
    num_pid_m = tl.cdiv(num_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    size_m = tl.maximum(size_m, 1)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    pid_m = tl.where(pid < num_pid_m * num_pid_n, pid_m, -1)
    return pid_m, pid_n


@triton.jit
def gate_up_silu_kernel(
    a_ptr,  # [tokens, K] activations (bf16/fp16, or e4m3 with a_scale)
    a_scale_ptr,  # [tokens, ceil(K / 128)] float32 (FP8 only)
    w_ptr,  # [E, 2N, K] gate rows then up rows
    w_scale_ptr,  # [E, ceil(2N / 128), ceil(K / 128)] float32 (FP8 only)
    out_ptr,  # [capacity, N] silu(gate) * up, by sorted row
    out_scale_ptr,  # [capacity, ceil(N / 128)] float32 (QUANT_OUT only)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    N,
    K,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    stride_osm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    DOT_F32: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr = None,  # DeepSeek-V4's clamp of gate and up; None: plain SwiGLU
    FP4: tl.constexpr = False,  # w packed e2m1 [E, 2N, K / 2], w_scale ue8m0 bytes [E, 2N, K / 32]
):
    pid_m, pid_n = _tile_order(tl.program_id(0), tl.load(num_padded_ptr), N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m < 0:
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + tokens[:, None] * stride_am + offs_k[None, :]
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    if FP8:
        a_scale_ptrs = a_scale_ptr + tokens * stride_asm
        gate_scale_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // QUANT_GROUP) * stride_wsn
        up_scale_ptrs = w_scale_ptr + expert * stride_wse + ((offs_n + N) // QUANT_GROUP) * stride_wsn

    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP4:
        a_rows = a_ptr + tokens * stride_am
        gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
        gate_scales = w_scale_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            gate = _fp4_dot(a_rows, row_ok, gate_rows, gate_scales, kb, K, n_ok, gate, BLOCK_K, DOT_F32)
            up = _fp4_dot(
                a_rows, row_ok, gate_rows + N * stride_wn, gate_scales + N * stride_wsn, kb, K, n_ok, up, BLOCK_K,
                DOT_F32,
            )  # fmt: skip
    else:
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_gate = tl.load(gate_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w_up = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                w_gate = w_gate.to(tl.float32)
                w_up = w_up.to(tl.float32)
            if FP8:
                group = (kb * BLOCK_K) // QUANT_GROUP
                a_scale = tl.load(a_scale_ptrs + group, mask=row_ok, other=0.0)
                gate_scale = tl.load(gate_scale_ptrs + group, mask=n_ok, other=0.0)
                up_scale = tl.load(up_scale_ptrs + group, mask=n_ok, other=0.0)
                gate += tl.dot(a, w_gate) * (a_scale[:, None] * gate_scale[None, :])
                up += tl.dot(a, w_up) * (a_scale[:, None] * up_scale[None, :])
            else:
                gate = tl.dot(a, w_gate, gate)
                up = tl.dot(a, w_up, up)
            a_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K

    if SWIGLU_LIMIT is not None:
        gate = tl.minimum(gate, SWIGLU_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, in float32
    rows = offs_m.to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    # Padding rows are written too (zeros: their activations were masked to 0); the
    # buffer holds every row below capacity, and the down GEMM masks them out.
    if QUANT_OUT:
        # One tile is one 128-column group (BLOCK_N == 128, checked by the launcher).
        # DOT_F32 means "interpreted", which also needs the emulated e4m3 rounding.
        scale = tl.maximum(tl.max(tl.abs(act), axis=1) / FP8_MAX, MIN_SCALE)
        q = tl.clamp(act / scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(out_ptrs, to_e4m3(q, DOT_F32), mask=n_ok[None, :])
        tl.store(out_scale_ptr + rows * stride_osm + pid_n, scale)
    else:
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def down_kernel(
    a_ptr,  # [capacity, K] activations by sorted row (bf16/fp16, or e4m3 with a_scale)
    a_scale_ptr,  # [capacity, ceil(K / 128)] float32 (FP8 only)
    w_ptr,  # [E, N, K]
    w_scale_ptr,  # [E, ceil(N / 128), ceil(K / 128)] float32 (FP8 only)
    out_ptr,  # [num_pairs, N]: row of each (token, slot) pair
    topk_weights_ptr,  # [num_pairs] float32 (WEIGHTED only)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT_F32: tl.constexpr,
    FP4: tl.constexpr = False,  # as gate_up_silu_kernel's
):
    pid_m, pid_n = _tile_order(tl.program_id(0), tl.load(num_padded_ptr), N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m < 0:
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    if FP8:
        a_scale_ptrs = a_scale_ptr + rows * stride_asm
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // QUANT_GROUP) * stride_wsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP4:
        w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
        scale_rows = w_scale_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            acc = _fp4_dot(a_ptr + rows * stride_am, row_ok, w_rows, scale_rows, kb, K, n_ok, acc, BLOCK_K, DOT_F32)
    else:
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if FP8:
                group = (kb * BLOCK_K) // QUANT_GROUP
                a_scale = tl.load(a_scale_ptrs + group, mask=row_ok, other=0.0)
                w_scale = tl.load(w_scale_ptrs + group, mask=n_ok, other=0.0)
                acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
            else:
                acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

    if WEIGHTED:
        acc *= tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------- configs


@attrs.frozen
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@attrs.frozen
class MoEConfigs:
    """One launch's tiles: both GEMMs share ``block_m`` (the alignment's)."""

    gate_up: GemmConfig
    down: GemmConfig

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


def pick_configs(capability: tuple[int, int], fp8: bool, rows_per_expert: float) -> MoEConfigs:
    """Tiles for this GPU generation, operand type and load.

    Decode-sized batches (few rows per expert) take 64-row M-blocks, which waste
    less padding; larger ones take 128-row blocks with 8 warps (on SM90 the two
    128x128 float32 gate/up accumulators live in registers: 128 per thread at 8
    warps). K blocks are 64 bf16/fp16 or 128 e4m3 elements (128 bytes either way;
    FP8's equals a scale block). Gate/up tiles are 128 wide, one activation scale
    group for the fused FP8 quantisation. Stages fill at most ~165 KB of the 227 KB
    of shared memory both SM90 and SM100 give a block. Every config compiles to
    tcgen05 MMA on SM100 and wgmma on SM90 (``aot_specs`` lists them for that
    check); SM100 and SM90 share them until measurements say otherwise.
    """
    del capability  # one table for both generations (see above)
    block_k = 128 if fp8 else 64
    if rows_per_expert <= 64:
        return MoEConfigs(
            gate_up=GemmConfig(64, 128, block_k, num_warps=4, num_stages=4),
            down=GemmConfig(64, 128, block_k, num_warps=4, num_stages=4),
        )
    return MoEConfigs(
        gate_up=GemmConfig(128, 128, block_k, num_warps=8, num_stages=3),
        down=GemmConfig(128, 128, block_k, num_warps=8, num_stages=4),
    )


# --------------------------------------------------------------------------- launchers


def _grid(align: Alignment, block_n: int, n: int) -> tuple[int]:
    # Sized by the capacity (known on the host); programs past ``num_padded`` exit.
    return (align.capacity // align.block_m * triton.cdiv(n, block_n),)


def gate_up_silu(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    align: Alignment,
    top_k: int,
    config: GemmConfig,
    out_dtype: torch.dtype,
    swiglu_limit: float | None = None,
    fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(a @ gate.T) * (a @ up.T)`` per sorted row, ``[capacity, I]`` in ``out_dtype``;
    with ``swiglu_limit``, gate is clamped above and up on both sides first (DeepSeek-V4).

    Rows gather token ``pair // top_k`` of ``a``. With ``out_dtype`` e4m3 the result is
    quantised per row and 128 columns, and its float32 scales come back too. With ``fp4``
    ``w13`` holds packed e2m1 codes and ``w13_scale`` their ue8m0 bytes (per 32 columns),
    dequantised tile by tile to ``a``'s dtype.
    """
    intermediate, hidden = w13.shape[1] // 2, w13.shape[2] * (2 if fp4 else 1)
    fp8_in = a_scale is not None
    quant_out = out_dtype == torch.float8_e4m3fn
    if quant_out and config.block_n != 128:
        raise ValueError(f"FP8 output needs 128-wide gate/up tiles (one scale group), got {config.block_n}")
    out = torch.empty((align.capacity, intermediate), dtype=out_dtype, device=a.device)
    out_scale = (
        torch.empty((align.capacity, triton.cdiv(intermediate, 128)), dtype=torch.float32, device=a.device)
        if quant_out
        else None
    )
    if align.capacity == 0:
        return out, out_scale
    a_scale_t = a_scale if fp8_in else a
    w_scale_t = w13_scale if fp8_in or fp4 else w13
    out_scale_t = out_scale if quant_out else out
    gate_up_silu_kernel[_grid(align, config.block_n, intermediate)](
        a, a_scale_t, w13, w_scale_t, out, out_scale_t,
        align.sorted_pairs, align.block_experts, align.num_padded,
        align.num_pairs, top_k, intermediate, hidden,
        a.stride(0), a_scale_t.stride(0), w13.stride(0), w13.stride(1), w_scale_t.stride(0), w_scale_t.stride(1),
        out.stride(0), out_scale_t.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        FP8=fp8_in, QUANT_OUT=quant_out, DOT_F32=interpreting(),
        SWIGLU_LIMIT=None if swiglu_limit is None else float(swiglu_limit), FP4=fp4,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, out_scale


def down(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    align: Alignment,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    config: GemmConfig,
    fp4: bool = False,
) -> torch.Tensor:
    """``a @ w2.T`` per sorted row (times its routing weight, when given) into row
    ``pair`` of ``out`` ``[num_pairs, H]``; rows of dropped pairs are not written.
    ``fp4``: packed FP4 ``w2``, as ``gate_up_silu``'s."""
    hidden, intermediate = w2.shape[1], w2.shape[2] * (2 if fp4 else 1)
    if align.capacity == 0:
        return out
    fp8 = a_scale is not None
    a_scale_t = a_scale if fp8 else a
    w_scale_t = w2_scale if fp8 or fp4 else w2
    weights_t = topk_weights if topk_weights is not None else align.sorted_pairs
    down_kernel[_grid(align, config.block_n, hidden)](
        a, a_scale_t, w2, w_scale_t, out, weights_t,
        align.sorted_pairs, align.block_experts, align.num_padded,
        align.num_pairs, hidden, intermediate,
        a.stride(0), a_scale_t.stride(0), w2.stride(0), w2.stride(1), w_scale_t.stride(0), w_scale_t.stride(1),
        out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        FP8=fp8, WEIGHTED=topk_weights is not None, DOT_F32=interpreting(), FP4=fp4,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- ahead of time

_INTS = ("num_pairs", "N", "K", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wse", "stride_wsn")


def _spec(name: str, fn, pointers: dict[str, str], ints: tuple[str, ...], constexprs: dict, config: GemmConfig) -> dict:
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    signature = {arg: signature[arg] for arg in fn.arg_names}
    aligned = tuple(arg for arg in ints if arg.startswith("stride_") or arg in ("N", "K"))
    return {
        "name": name,
        "fn": fn,
        "signature": signature,
        "constexprs": constexprs,
        "attrs": divisibility_attrs(fn, signature, aligned),
        "options": {"num_warps": config.num_warps, "num_stages": config.num_stages},
        "mma": True,  # a GEMM: must use the target's tensor-core MMA (test_aot.py)
    }


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """Both GEMMs as the launcher compiles them on ``capability``: bf16 and FP8
    experts, decode-sized (64-row) and prefill-sized (128-row) M-blocks.

    Each spec also has ``attrs`` (16-divisibility of pointers, strides, N and K) for
    ``ASTSource(..., attrs=spec["attrs"])``: the specialisation a runtime launch on
    real widths gets, without which the K loop is not pipelined."""
    specs = []
    for fp8 in (False, True):
        act = "*fp8e4nv" if fp8 else "*bf16"
        for load, rows_per_expert in (("small", 1.0), ("large", 1024.0)):
            configs = pick_configs(capability, fp8, rows_per_expert)
            tag = f"{'fp8' if fp8 else 'bf16'}_{load}"
            common = {"sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_padded_ptr": "*i32"}
            scale = "*fp32"
            g = configs.gate_up
            specs.append(
                _spec(
                    f"gate_up_silu_{tag}",
                    gate_up_silu_kernel,
                    {
                        "a_ptr": "*bf16" if not fp8 else "*fp8e4nv",
                        "a_scale_ptr": scale,
                        "w_ptr": act,
                        "w_scale_ptr": scale,
                        "out_ptr": act,
                        "out_scale_ptr": scale,
                        **common,
                    },
                    (*_INTS, "top_k", "stride_om", "stride_osm"),
                    {
                        "BLOCK_M": g.block_m,
                        "BLOCK_N": g.block_n,
                        "BLOCK_K": g.block_k,
                        "GROUP_M": g.group_m,
                        "FP8": fp8,
                        "QUANT_OUT": fp8,
                        "DOT_F32": False,
                        "SWIGLU_LIMIT": None,
                        "FP4": False,
                    },
                    g,
                )  # fmt: skip
            )
            d = configs.down
            specs.append(
                _spec(
                    f"down_{tag}",
                    down_kernel,
                    {
                        "a_ptr": act,
                        "a_scale_ptr": scale,
                        "w_ptr": act,
                        "w_scale_ptr": scale,
                        "out_ptr": "*bf16",
                        "topk_weights_ptr": "*fp32",
                        **common,
                    },
                    (*_INTS, "stride_om"),
                    {
                        "BLOCK_M": d.block_m,
                        "BLOCK_N": d.block_n,
                        "BLOCK_K": d.block_k,
                        "GROUP_M": d.group_m,
                        "FP8": fp8,
                        "WEIGHTED": True,
                        "DOT_F32": False,
                        "FP4": False,
                    },
                    d,
                )  # fmt: skip
            )
    for load, rows_per_expert in (("small", 1.0), ("large", 1024.0)):
        configs = pick_configs(capability, False, rows_per_expert)
        common = {"sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_padded_ptr": "*i32"}
        packed = {"a_scale_ptr": "*fp32", "w_ptr": "*u8", "w_scale_ptr": "*u8"}
        g, d = configs.gate_up, configs.down
        gate_up = {"BLOCK_M": g.block_m, "BLOCK_N": g.block_n, "BLOCK_K": g.block_k, "GROUP_M": g.group_m}
        specs.append(
            _spec(
                f"gate_up_silu_fp4_{load}",
                gate_up_silu_kernel,
                {"a_ptr": "*bf16", **packed, "out_ptr": "*bf16", "out_scale_ptr": "*bf16", **common},
                (*_INTS, "top_k", "stride_om", "stride_osm"),
                {**gate_up, "FP8": False, "QUANT_OUT": False, "DOT_F32": False, "SWIGLU_LIMIT": 10.0, "FP4": True},
                g,
            )
        )
        down_tiles = {"BLOCK_M": d.block_m, "BLOCK_N": d.block_n, "BLOCK_K": d.block_k, "GROUP_M": d.group_m}
        specs.append(
            _spec(
                f"down_fp4_{load}",
                down_kernel,
                {"a_ptr": "*bf16", **packed, "out_ptr": "*bf16", "topk_weights_ptr": "*fp32", **common},
                (*_INTS, "stride_om"),
                {**down_tiles, "FP8": False, "WEIGHTED": True, "DOT_F32": False, "FP4": True},
                d,
            )
        )
    return specs
