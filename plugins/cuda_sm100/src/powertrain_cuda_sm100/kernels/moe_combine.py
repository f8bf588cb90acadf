"""The last step of a routed MoE: each token's weighted expert rows, summed over its slots.

The down GEMM writes one (already weighted) row per (token, slot) pair; here each
token adds its ``top_k`` rows in slot order in float32 and rounds once. A fixed
order instead of atomic adds keeps the output bit-identical from run to run (and
independent of the rest of the batch). Slots routed to another rank's experts
were never written: they are skipped by id, so the per-pair buffer needs no
zeroing pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100.kernels.common import divisibility_attrs


@triton.jit
def combine_kernel(
    pair_rows_ptr,  # [tokens * top_k, H]
    topk_ids_ptr,  # [tokens, top_k] global ids, contiguous
    out_ptr,  # [tokens, H]
    top_k,
    H,
    first_expert,
    local_experts,
    stride_pm,
    stride_om,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in range(0, top_k):
        pair = token * top_k + slot
        # The id as a vector, so the mask is one (the interpreter refuses scalar & vector masks).
        local = tl.load(topk_ids_ptr + pair + tl.zeros((BLOCK_H,), dtype=tl.int64)) - first_expert
        is_local = (local >= 0) & (local < local_experts)
        row = tl.load(pair_rows_ptr + pair * stride_pm + offs_h, mask=h_ok & is_local, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


BLOCK_H = 1024
NUM_WARPS = 4


def combine(
    pair_rows: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, local_experts: int, out: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum over local slots k of pair_rows[t * top_k + k]``."""
    tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    if tokens == 0:
        return out
    block_h = min(BLOCK_H, triton.next_power_of_2(hidden))
    grid = (tokens, triton.cdiv(hidden, block_h))
    combine_kernel[grid](
        pair_rows, topk_ids.contiguous(), out, top_k, hidden, first_expert, local_experts,
        pair_rows.stride(0), out.stride(0), BLOCK_H=block_h, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """The combine for bf16 rows and int32 ids, as launched on wide layers."""
    ints = ("top_k", "H", "first_expert", "local_experts", "stride_pm", "stride_om")
    signature = {"pair_rows_ptr": "*bf16", "topk_ids_ptr": "*i32", "out_ptr": "*bf16", **dict.fromkeys(ints, "i32")}
    return [
        {
            "name": "combine_bf16",
            "fn": combine_kernel,
            "signature": {**signature, "BLOCK_H": "constexpr"},
            "constexprs": {"BLOCK_H": BLOCK_H},
            "attrs": divisibility_attrs(
                combine_kernel, {**signature, "BLOCK_H": "constexpr"}, ("H", "stride_pm", "stride_om")
            ),
            "options": {"num_warps": NUM_WARPS, "num_stages": 1},
        }
    ]
