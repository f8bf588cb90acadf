"""Each row's ``width`` largest float32 scores, best first: the Lightning Indexer's top-k.

One program takes one row (a query token's scores over up to 128k keys, top-2048 for
DeepSeek-V3.2 and V4) and finds it in three steps without sorting the row:

1. **Radix select.** Scores become order-preserving 32-bit keys (a float's bits, the sign
   bit flipped, negatives' bits all flipped). Four passes over the row, a byte at a time
   from the top, each histogram counting only the keys that match the byte prefix chosen
   so far, pin down the ``width``-th largest key ``T`` exactly, and how many keys equal to
   ``T`` belong to the top ``width``.
2. **Compaction.** A fifth pass writes every key above ``T`` and the first of those equal
   to it, with their columns, to ``width`` candidate slots (positions from a running
   prefix sum): exactly ``width`` of them, in column order.
3. **Sort.** The candidates, each packed as ``key << 32 | column`` in 64 bits, are sorted
   in registers (``tl.sort``, bitonic) and their columns stored best first. A ``-inf``
   score (a key the token cannot see) comes out as ``-1``.

Each pass reads the row once (five reads of 4 bytes a key); ``torch.topk``'s radix select
reads it a comparable number of times but in several launches, plus a sort. Ties between
equal scores come out in any order (the contract allows it): here, lower columns first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support
from powertrain_cuda_sm100.kernels.common import aot_spec

#: The most ``width`` one program sorts in registers (DeepSeek's ``index_topk`` is 2048).
MAX_WIDTH = 4096


@triton.jit
def _ordered(scores):
    """float32 -> uint32 keys in the same order (``-inf`` lowest but for negative NaNs)."""
    bits = scores.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def row_topk_kernel(
    scores_ptr,  # float32 [rows, columns]
    candidates_ptr,  # uint64 [rows, WIDTH_PAD]: scratch for step 2
    out_ptr,  # int32 [rows, width]
    columns,
    width,
    stride_s,
    stride_c,
    stride_o,
    BLOCK: tl.constexpr,  # scores per load
    WIDTH_PAD: tl.constexpr,  # width rounded up to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    scores = scores_ptr + row * stride_s
    candidates = candidates_ptr + row * stride_c
    digits = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    prefix_mask = tl.full([], 0, tl.uint32)
    remaining = width  # of the top width, how many are still to be found below the prefix
    for shift in tl.static_range(24, -8, -8):  # the key's bytes, top first
        counts = tl.zeros((256,), tl.int32)
        for start in range(0, columns, BLOCK):
            column = start + tl.arange(0, BLOCK)
            ok = column < columns
            key = _ordered(tl.load(scores + column, mask=ok, other=0.0))
            match = ok & ((key & prefix_mask) == prefix)
            counts += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        above = tl.sum(counts, 0) - tl.cumsum(counts, 0)  # keys whose byte is larger than each digit's
        chosen = (above < remaining) & (above + counts >= remaining)
        digit = tl.max(tl.where(chosen, digits, -1), 0)
        remaining -= tl.sum(tl.where(digits == digit, above, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
        prefix_mask = prefix_mask | (tl.full((), 0xFF, tl.uint32) << shift)
    # prefix is now the width-th largest key; remaining: how many keys equal to it to take.
    written = tl.full([], 0, tl.int32)
    equal_seen = tl.full([], 0, tl.int32)
    for start in range(0, columns, BLOCK):
        column = start + tl.arange(0, BLOCK)
        ok = column < columns
        key = _ordered(tl.load(scores + column, mask=ok, other=0.0))
        equal = ok & (key == prefix)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
        take = (ok & (key > prefix)) | (equal & (equal_rank < remaining))
        slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
        packed = (key.to(tl.uint64) << 32) | column.to(tl.uint64)
        tl.store(candidates + slot, packed, mask=take)
        written += tl.sum(take.to(tl.int32), 0)
        equal_seen += tl.sum(equal.to(tl.int32), 0)
    tl.debug_barrier()  # the candidates other threads wrote, before this thread reads them
    slots = tl.arange(0, WIDTH_PAD)
    filled = slots < width
    picked = tl.sort(tl.load(candidates + slots, mask=filled, other=0), descending=True)
    key = (picked >> 32).to(tl.uint32)
    column = (picked & 0xFFFFFFFF).to(tl.int32)
    unseen = key == _ordered(tl.full((WIDTH_PAD,), float("-inf"), tl.float32))
    tl.store(out_ptr + row * stride_o + slots, tl.where(unseen, -1, column), mask=filled)


def block_size(interpreting: bool = False) -> int:
    """Scores per load: small under the interpreter, so the tests cross several loads."""
    return 16 if interpreting else 1024


def row_topk(scores: torch.Tensor, width: int) -> torch.Tensor:
    """int32 ``[rows, width]``: each row's ``width`` largest scores' columns, best first,
    ``-1`` where the score is ``-inf`` (see the module doc). ``scores`` float32
    ``[rows, columns]``, last dimension contiguous; ``1 <= width <= min(columns, MAX_WIDTH)``."""
    rows, columns = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(
            f"row_topk takes float32 scores with a contiguous last dimension, got {scores.dtype} "
            f"with strides {scores.stride()}"
        )
    if not 1 <= width <= min(columns, MAX_WIDTH):
        raise ValueError(
            f"row_topk picks 1 to min(columns, {MAX_WIDTH}) = {min(columns, MAX_WIDTH)} per row, got {width}"
        )
    out = torch.empty((rows, width), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    width_pad = triton.next_power_of_2(width)
    candidates = torch.empty((rows, width_pad), dtype=torch.uint64, device=scores.device)
    row_topk_kernel[(rows,)](
        scores,
        candidates,
        out,
        columns,
        width,
        scores.stride(0),
        candidates.stride(0),
        out.stride(0),
        BLOCK=block_size(support.interpreting()),
        WIDTH_PAD=width_pad,
        num_warps=8,
    )
    return out


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """DeepSeek's top-2048 (V3.2's DSA and V4's CSA)."""
    types = {
        "scores_ptr": "*fp32",
        "candidates_ptr": "*u64",
        "out_ptr": "*i32",
        **dict.fromkeys(("columns", "width", "stride_s", "stride_c", "stride_o"), "i32"),
    }
    constexprs = {"BLOCK": block_size(), "WIDTH_PAD": 2048}
    return [aot_spec("row_topk_2048", row_topk_kernel, types, constexprs, {"num_warps": 8})]
