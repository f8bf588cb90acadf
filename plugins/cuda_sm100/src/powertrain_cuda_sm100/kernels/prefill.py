"""Ragged, chunked, causal GQA/MHA prefill over the paged cache (flash attention).

Sequence ``i``'s new tokens are the last ``query_len`` of its ``seq_len`` keys, all
already written to the cache: keys before them (an earlier chunk, a prefix-cache
hit) and the new ones are read the same way, through the block table, so chunked
prefill and speculative verification need no special path.

A program takes a tile of ``BLOCK_Q`` new tokens of one sequence times all query
heads of one kv head: its ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows are (token, head)
pairs, so each key/value tile feeds the whole GQA group from one read and the MMA
has a full M dimension even for a sequence of 2 new tokens (verification). It walks
key tiles up to its last token's position with an online softmax, masking per row
(causal, sliding window).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support
from powertrain_cuda_sm100.kernels.common import aot_spec, fp32_suffix, mma, padded, paged_kv_tile, typed

LOG2E = 1.4426950408889634


@triton.jit
def prefill_kernel(
    query_ptr,  # [num_tokens, heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_size]
    value_cache_ptr,
    block_tables_ptr,  # int32 [batch, max_blocks]
    seq_lens_ptr,  # int32 [batch]
    query_start_loc_ptr,  # int32 [batch + 1]
    out_ptr,  # [num_tokens, heads, head_size]
    qk_scale,  # softmax scale * log2(e)
    window,  # read when SLIDING
    first_seq,  # sequences before this one (decodes) are not this launch's
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
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_M // GROUP_PAD tokens x GROUP_PAD heads
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the longest sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    group = rows % GROUP_PAD
    head = kv_head * GROUP + group
    row_ok = (token < q_len) & (group < GROUP)
    position = context + token  # of each row's token in its sequence
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    flat_token = (q_start + token).to(tl.int64)
    q = tl.load(
        query_ptr + (flat_token * stride_qt + head * stride_qh)[:, None] + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Keys this tile's rows can see: up to its last token, from its first token's window on.
    end = tl.minimum(context + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q), seq_len)
    start = 0
    if SLIDING:
        start = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0)

    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        keys, key_ok, k, v = paged_kv_tile(
            table, key_cache_ptr, value_cache_ptr, tile, end, kv_head, dims, dim_ok,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip

        scores = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_F32) * qk_scale
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
        if SLIDING:
            visible &= keys[None, :] > position[:, None] - window
        scores = tl.where(visible, scores, -float("inf"))
        # A row may see nothing in a tile (its window starts later): keep its max at -inf
        # but subtract a finite number, so it gains exact zeros instead of NaN.
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_F32)
        m = m_new

    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + (flat_token * stride_ot + head * stride_oh)[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@attrs.frozen
class PrefillConfig:
    block_m: int  # (token, head) rows per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def prefill_config(
    capability: tuple[int, int], group_pad: int, max_query_len: int, interpreting: bool = False, element_size: int = 2
) -> PrefillConfig:
    """Tile and launch sizes per target and batch shape.

    Short rows (verification, short chunks) take 64-row tiles so that a tile is not
    mostly padding; long prompts take 128 rows, the M of one tcgen05 MMA (two
    wgmma warpgroups on SM90). Float32 tiles (``element_size`` 4) take 32 keys in one
    stage: 64 keys in two would need 256 KiB of shared memory, more than the SM has
    (``test_aot`` checks every spec). Under the interpreter tiles are small so the tests'
    short sequences cross several query and key tiles.
    """
    if interpreting:
        return PrefillConfig(block_m=max(16, group_pad), block_n=16, num_warps=4, num_stages=1)
    block_m = 64 if max_query_len * group_pad <= 64 else 128
    block_m = max(block_m, group_pad)
    if element_size > 2:
        return PrefillConfig(block_m=block_m, block_n=32, num_warps=4 if block_m == 64 else 8, num_stages=1)
    if capability >= (10, 0):
        return PrefillConfig(block_m=block_m, block_n=64, num_warps=4 if block_m == 64 else 8, num_stages=3)
    return PrefillConfig(block_m=block_m, block_n=64, num_warps=4 if block_m == 64 else 8, num_stages=2)


def prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    sliding_window: int | None = None,
    capability: tuple[int, int] = (10, 0),
) -> None:
    """Attend the new tokens of sequences ``first_seq ... first_seq + num_seqs - 1``
    (rows of the flat ``query`` per ``query_start_loc``) causally over their cached
    keys; write their rows of ``out``.

    ``max_query_len`` (host int) is the most new tokens any of them has.
    """
    if num_seqs == 0:
        return
    _, num_heads, head_size = query.shape
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    interpreting = support.interpreting()
    config = prefill_config(
        capability, group_pad, max_query_len, interpreting=interpreting, element_size=query.element_size()
    )
    tokens_per_tile = config.block_m // group_pad
    grid = (num_seqs, triton.cdiv(max_query_len, tokens_per_tile), kv_heads)
    prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        sliding_window or 0,
        first_seq,
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
        HEAD_SIZE=head_size,
        HEAD_PAD=padded(head_size),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        SLIDING=sliding_window is not None,
        DOT_F32=interpreting,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


_INTS = dict.fromkeys(
    (
        "window",
        "first_seq",
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
    ),
    "i32",
)


def aot_specs(capability: tuple[int, int], element_size: int = 2) -> list[dict]:
    """bf16 prefill (float32 with ``element_size`` 4), head size 128, block size 16: MHA and
    GQA groups of 4 and 8, long prompts (128-row tiles) and verification-sized rows (64-row
    tiles), plus a sliding window."""
    types = {
        "query_ptr": "*bf16",
        "key_cache_ptr": "*bf16",
        "value_cache_ptr": "*bf16",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "out_ptr": "*bf16",
        "qk_scale": "fp32",
        **_INTS,
    }
    specs = []
    for group, max_query_len, sliding in ((1, 4096, False), (4, 4096, False), (8, 4096, True), (4, 8, False)):
        group_pad = triton.next_power_of_2(group)
        config = prefill_config(capability, group_pad, max_query_len, element_size=element_size)
        constexprs = {
            "HEAD_SIZE": 128,
            "HEAD_PAD": 128,
            "GROUP": group,
            "GROUP_PAD": group_pad,
            "BLOCK_SIZE": 16,
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "SLIDING": sliding,
            "DOT_F32": False,
        }
        name = f"prefill_g{group}_m{config.block_m}{'_sliding' if sliding else ''}{fp32_suffix(element_size)}"
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        # Every tile here has at least 64 (token, head) rows: tensor-core MMA (test_aot.py).
        specs.append({**aot_spec(name, prefill_kernel, typed(types, element_size), constexprs, options), "mma": True})
    return specs
