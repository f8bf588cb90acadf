"""Combining split-KV partial results: the second kernel of split-KV decode.

A split attends over one stretch of a sequence's keys and leaves, per query head,
its output normalised by its own softmax sum and that sum's log (``lse``, base 2,
max included). The true output is the ``2**lse``-weighted mean of the split outputs.
A split that saw no keys (a short sequence in a batch split for a long one) leaves
``lse = -inf`` and a zero output, and weighs exactly nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100.kernels.common import aot_spec, padded


@triton.jit
def combine_splits_kernel(
    part_out_ptr,  # float32 [rows, heads, splits, head_size]
    part_lse_ptr,  # float32 [rows, heads, splits]
    out_ptr,  # [rows, heads, head_size], the output dtype
    num_splits,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_lr,
    stride_lh,
    stride_or,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    lse_base = part_lse_ptr + row * stride_lr + head * stride_lh

    # Two passes over the few splits: the max first, so no weight overflows.
    top = tl.full([], -float("inf"), tl.float32)
    for s in range(num_splits):
        top = tl.maximum(top, tl.load(lse_base + s))
    top = tl.where(top == -float("inf"), 0.0, top)

    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for s in range(num_splits):
        weight = tl.exp2(tl.load(lse_base + s) - top)
        part = tl.load(part_out_ptr + row * stride_pr + head * stride_ph + s * stride_ps + dims, mask=dim_ok, other=0.0)
        acc += weight * part
        total += weight
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _num_warps(head_size: int) -> int:
    return 4 if head_size >= 256 else 2


def partial_buffers(
    rows: int, heads: int, num_splits: int, head_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised float32 buffers for split outputs and their lse: every split writes both."""
    part_out = torch.empty((rows, heads, num_splits, head_size), dtype=torch.float32, device=device)
    part_lse = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=device)
    return part_out, part_lse


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Write into ``out`` ``[rows, heads, head_size]`` the combination of the splits."""
    rows, heads, num_splits, head_size = part_out.shape
    if rows == 0:
        return
    combine_splits_kernel[(rows, heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_SIZE=head_size,
        HEAD_PAD=padded(head_size),
        num_warps=_num_warps(head_size),
    )


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """The combine kernel for bf16 outputs of head sizes 128 (GQA) and 512 (MLA latent)."""
    ints = ("num_splits", "stride_pr", "stride_ph", "stride_ps", "stride_lr", "stride_lh", "stride_or", "stride_oh")
    types = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", **dict.fromkeys(ints, "i32")}
    return [
        aot_spec(
            f"combine_splits_d{head_size}",
            combine_splits_kernel,
            types,
            {"HEAD_SIZE": head_size, "HEAD_PAD": padded(head_size)},
            {"num_warps": _num_warps(head_size), "num_stages": 1},
        )
        for head_size in (128, 512)
    ]
