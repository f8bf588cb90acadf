"""Paged GQA/MHA decode attention (one new token per sequence), split over the KV.

Reads the engine's block-token-major cache (``[num_blocks, block_size, kv_heads,
head_size]``) in place through the block table: each key tile gathers its tokens'
blocks, so any cache block size works with any tile size, and nothing is copied
into another layout.

One program serves all query heads of one kv head (the GQA group, padded to the
16 rows a dot needs), so each key/value tile is read once per group rather than
once per query head. Decode is bound by reading the cache; with few sequences the
grid would be too small to keep the GPU's SMs reading, so a sequence's keys are cut
into splits, each split writes its partial output and softmax statistics, and
``split_kv.combine_splits`` merges them. Splitting is skipped when one split suffices.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support
from powertrain_cuda_sm100.kernels.common import (
    aot_spec,
    choose_num_splits,
    fp32_suffix,
    mma,
    padded,
    paged_kv_tile,
    sm_count,
    typed,
)
from powertrain_cuda_sm100.kernels.split_kv import combine_splits, partial_buffers

LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    query_ptr,  # [batch, heads, head_size]: row i is sequence i's one new token
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_size]
    value_cache_ptr,
    block_tables_ptr,  # int32 [batch, max_blocks]
    seq_lens_ptr,  # int32 [batch]
    out_ptr,  # [batch, heads, head_size] (written when not SPLIT)
    part_out_ptr,  # float32 [batch, heads, splits, head_size] (written when SPLIT)
    part_lse_ptr,  # float32 [batch, heads, splits]
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    window,  # sliding window (keys per token, itself included); read when SLIDING
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per tile
    SLIDING: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    # Splits cover whole tiles of the visible keys; trailing splits of a short sequence are empty.
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    groups = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + groups
    head_ok = groups < GROUP
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(
        query_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    m = tl.full([GROUP_PAD], -float("inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        keys, key_ok, k, v = paged_kv_tile(
            table, key_cache_ptr, value_cache_ptr, tile, end, kv_head, dims, dim_ok,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        scores = mma(q, tl.trans(k), tl.zeros([GROUP_PAD, BLOCK_N], tl.float32), DOT_F32) * qk_scale
        scores = tl.where(key_ok[None, :], scores, -float("inf"))
        # Every tile holds at least one visible key (tiles start inside [start, end)): m stays finite.
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_F32)
        m = m_new

    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        lse = tl.where(seen, m + tl.log2(tl.where(seen, total, 1.0)), -float("inf"))
        part_rows = part_out_ptr + seq.to(tl.int64) * stride_pt + heads * stride_ph + split * stride_ps
        tl.store(part_rows[:, None] + dims[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_lt + heads * stride_lh + split, lse, mask=head_ok)
    else:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@attrs.frozen
class DecodeConfig:
    block_n: int  # keys per tile
    min_split: int  # fewest keys worth a split of their own
    num_warps: int
    num_stages: int


def decode_config(capability: tuple[int, int], interpreting: bool = False) -> DecodeConfig:
    """Tile and launch sizes per target.

    Under the interpreter tiles are small so that the tests' short sequences cross
    several tiles and splits; that is where the online softmax and the split merge
    can go wrong.
    """
    if interpreting:
        return DecodeConfig(block_n=16, min_split=16, num_warps=4, num_stages=1)
    if capability >= (10, 0):
        return DecodeConfig(block_n=64, min_split=256, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=64, min_split=256, num_warps=4, num_stages=2)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    capability: tuple[int, int] = (10, 0),
    num_splits: int | None = None,
) -> None:
    """Attend each row of ``query`` ``[batch, heads, head_size]`` (sequence ``i``'s one
    new token, already in the cache) over its ``seq_lens[i]`` keys; write ``out``.

    ``max_seq_len`` (a host int: the longest of these sequences) sizes the splits;
    ``num_splits`` overrides the choice (tests use it).
    """
    batch, num_heads, head_size = query.shape
    if batch == 0:
        return
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    interpreting = support.interpreting()
    config = decode_config(capability, interpreting=interpreting)
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(batch * kv_heads, span, sm_count(query.device), config.min_split)
    split = num_splits > 1
    if split:
        part_out, part_lse = partial_buffers(batch, num_heads, num_splits, head_size, query.device)
    else:  # never written: any float32 tensor will do
        part_out = part_lse = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    paged_decode_kernel[(batch, kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        sliding_window or 0,
        num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        HEAD_SIZE=head_size,
        HEAD_PAD=padded(head_size),
        GROUP=group,
        GROUP_PAD=padded(group),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_N=config.block_n,
        SLIDING=sliding_window is not None,
        SPLIT=split,
        DOT_F32=interpreting,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        combine_splits(part_out, part_lse, out)


#: Every integer parameter of the kernel (lengths, window, strides) is an i32.
_INTS = dict.fromkeys(
    (
        "window",
        "num_splits",
        "stride_qt",
        "stride_qh",
        "stride_kb",
        "stride_kt",
        "stride_kh",
        "stride_vb",
        "stride_vt",
        "stride_vh",
        "stride_bt",
        "stride_ot",
        "stride_oh",
        "stride_pt",
        "stride_ph",
        "stride_ps",
        "stride_lt",
        "stride_lh",
    ),
    "i32",
)


def aot_specs(capability: tuple[int, int], element_size: int = 2) -> list[dict]:
    """bf16 decode (float32 with ``element_size`` 4) for head size 128 at block size 16, GQA
    groups 1/4/8, split and not."""
    config = decode_config(capability)
    types = {
        "query_ptr": "*bf16",
        "key_cache_ptr": "*bf16",
        "value_cache_ptr": "*bf16",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "out_ptr": "*bf16",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "qk_scale": "fp32",
    }
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    specs = []
    for group in (1, 4, 8):
        for split in (False, True):
            constexprs = {
                "HEAD_SIZE": 128,
                "HEAD_PAD": 128,
                "GROUP": group,
                "GROUP_PAD": padded(group),
                "BLOCK_SIZE": 16,
                "BLOCK_N": config.block_n,
                "SLIDING": False,
                "SPLIT": split,
                "DOT_F32": False,
            }
            name = f"paged_decode_g{group}{'_split' if split else ''}{fp32_suffix(element_size)}"
            specs.append(aot_spec(name, paged_decode_kernel, typed(types | _INTS, element_size), constexprs, options))
    return specs
