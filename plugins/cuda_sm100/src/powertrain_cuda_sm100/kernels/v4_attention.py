"""DeepSeek-V4 attention (``V4AttentionBackend``): shared-KV multi-query attention over a
sliding window of raw keys plus compressed entries, with one sink logit per head.

V4 has a single 512-wide key head that is also the value, so a program takes one query
token and ``BLOCK_H`` of its heads: each key tile it gathers serves all of them as key
and as value (the weight-absorbed MLA pattern, ``mla.shared_kv_softmax_tile``). A
token's keys are two stretches read through two block tables: its window, positions
``max(0, p - W + 1) .. p`` of the sliding class's ``kv`` pages, then its compressed
entries from the full-history class (every closed one for HCA, the indexer's list for
CSA, -1 padding anywhere). The token's position comes from the step's lengths on the
device, so a launch needs no host data beyond the shapes.

A decode batch has few tokens, so decode-sized launches split each token's keys (the
window and entries laid end to end) like split-KV decode; ``split_kv.combine_splits``
merges the parts. The sink joins split 0's softmax sum as a key with a zero value, which
the merge then weighs like any other key.

With ``ROPE_PAIRS`` the output leaves de-rotated (V4's "o-RoPE": the trailing dims'
adjacent pairs turned back by the token's rotary angle). The rotation is linear, so each
program turns its unnormalised accumulator before the store: the division by the softmax
sum, and the split merge's weighted sum, commute with it. No pass over the output follows.
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
    paged_rows,
    sm_count,
    typed,
)
from powertrain_cuda_sm100.kernels.mla import shared_kv_softmax_tile, store_latent_rows
from powertrain_cuda_sm100.kernels.split_kv import combine_splits, partial_buffers

LOG2E = 1.4426950408889634
#: What a token reads besides its window: nothing (sliding layers), every closed entry
#: (HCA) or the entries its row of the index list names (CSA).
NO_ENTRIES, ALL_CLOSED, LISTED = 0, 1, 2
# The same, as the kernel reads globals.
_ALL_CLOSED, _LISTED, _NO_ENTRIES = tl.constexpr(ALL_CLOSED), tl.constexpr(LISTED), tl.constexpr(NO_ENTRIES)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def v4_attention_kernel(
    q_ptr,  # [num_tokens, heads, head]
    kv_ptr,  # [window_blocks, block_size, head]: the sliding class's raw keys
    entries_ptr,  # [full_blocks, block_size // rate, head]: compressed entries
    window_tables_ptr,  # int32 [batch, max_blocks]
    full_tables_ptr,  # int32 [batch, max_blocks]
    token_seqs_ptr,  # int32 [num_tokens]: each query row's sequence
    query_start_ptr,  # int32 [batch + 1]
    seq_lens_ptr,  # int32 [batch]
    indices_ptr,  # int32 [num_tokens, topk]: listed entries, -1 padding (LISTED)
    sinks_ptr,  # float32 [heads]
    cos_ptr,  # [num_tokens, ROPE_PAIRS]: the rotary table at each token's position
    sin_ptr,  # [num_tokens, ROPE_PAIRS]
    out_ptr,  # [num_tokens, heads, head] (written when not SPLIT)
    part_out_ptr,  # float32 [num_tokens, heads, splits, head] (SPLIT)
    part_lse_ptr,  # float32 [num_tokens, heads, splits] (SPLIT)
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    window,
    rate,
    topk,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_eb,
    stride_et,
    stride_wt,
    stride_ft,
    stride_it,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_st,
    stride_sh,
    stride_ct,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per block
    ENTRIES_PER_BLOCK: tl.constexpr,
    ENTRIES: tl.constexpr,  # NO_ENTRIES, ALL_CLOSED or LISTED
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,  # 0: the output as attended
):
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < num_heads
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD
    seq = tl.load(token_seqs_ptr + token).to(tl.int64)
    position = tl.load(seq_lens_ptr + seq) - (tl.load(query_start_ptr + seq + 1) - token)
    q = tl.load(
        q_ptr + (token * stride_qt + head * stride_qh)[:, None] + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # The token's keys laid end to end: window positions lo..position, then its entries.
    lo = tl.maximum(position - window + 1, 0)
    in_window = position - lo + 1
    if ENTRIES == _ALL_CLOSED:
        in_entries = (position + 1) // rate
    elif ENTRIES == _LISTED:
        in_entries = topk
    else:
        in_entries = 0
    per_split = tl.cdiv(tl.cdiv(in_window + in_entries, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, in_window + in_entries)

    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    window_table = window_tables_ptr + seq * stride_wt
    for tile in range(start, tl.minimum(end, in_window), BLOCK_N):
        column = tile + tl.arange(0, BLOCK_N)
        ok = column < tl.minimum(end, in_window)
        keys = paged_rows(kv_ptr, window_table, lo + column, ok, BLOCK_SIZE, stride_kb, stride_kt, dims, dim_ok)
        scores = mma(q, tl.trans(keys), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_F32) * qk_scale
        visible = tl.broadcast_to(ok[None, :], (BLOCK_H, BLOCK_N))
        m, total, acc = shared_kv_softmax_tile(scores, keys, visible, m, total, acc, DOT_F32)
    if ENTRIES != _NO_ENTRIES:
        full_table = full_tables_ptr + seq * stride_ft
        first = tl.maximum(start, in_window) - in_window
        last = end - in_window
        for tile in range(first, last, BLOCK_N):
            column = tile + tl.arange(0, BLOCK_N)
            ok = column < last
            if ENTRIES == _LISTED:
                entry = tl.load(indices_ptr + token * stride_it + column, mask=ok, other=-1)
                ok = entry >= 0
            else:
                entry = column
            keys = paged_rows(entries_ptr, full_table, entry, ok, ENTRIES_PER_BLOCK, stride_eb, stride_et, dims, dim_ok)
            scores = mma(q, tl.trans(keys), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_F32) * qk_scale
            visible = tl.broadcast_to(ok[None, :], (BLOCK_H, BLOCK_N))
            m, total, acc = shared_kv_softmax_tile(scores, keys, visible, m, total, acc, DOT_F32)

    if split == 0:  # the sink: one more key, of value zero, in one split only
        sink = tl.load(sinks_ptr + head, mask=head_ok, other=0.0) * _LOG2E
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        total = total * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m = m_new
    if ROPE_PAIRS > 0:
        acc = derotated(acc, cos_ptr + token * stride_ct, sin_ptr + token * stride_ct, HEAD, ROPE_PAIRS)
    store_latent_rows(
        out_ptr + token * stride_ot + head * stride_oh,
        part_out_ptr + token * stride_pt + head * stride_ph + split * stride_ps,
        part_lse_ptr + token * stride_st + head * stride_sh + split,
        m,
        total,
        acc,
        dims,
        head_ok,
        dim_ok,
        SPLIT,
    )


@triton.jit
def derotated(acc, cos_row, sin_row, HEAD: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """``acc [rows, HEAD_PAD]`` with its trailing ``2 * ROPE_PAIRS`` of ``HEAD`` dims, as
    adjacent pairs ``(e, o)``, turned back by the angle whose cosine and sine are in
    ``cos_row``/``sin_row``: ``(e cos + o sin, o cos - e sin)``; the other dims as they are."""
    rows: tl.constexpr = acc.shape[0]
    half: tl.constexpr = acc.shape[1] // 2
    even, odd = tl.split(tl.reshape(acc, [rows, half, 2]))
    rope = tl.arange(0, half) - (HEAD // 2 - ROPE_PAIRS)  # the pair's column in the table
    turned = (rope >= 0) & (rope < ROPE_PAIRS)
    cos = tl.load(cos_row + rope, mask=turned, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(sin_row + rope, mask=turned, other=0.0).to(tl.float32)[None, :]
    return tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin), [rows, 2 * half])


@attrs.frozen
class V4AttentionConfig:
    block_h: int  # heads per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    min_split: int  # fewest keys worth a split


def v4_attention_config(num_heads: int, interpreting: bool = False, element_size: int = 2) -> V4AttentionConfig:
    """Tile and launch sizes: 64 heads a program where the layer has them (an MMA's M; V4
    has 64 or 128), else 16, as sparse MLA. Small tiles under the interpreter, so the
    tests cross several tiles and splits. Float32 (``element_size`` 4) takes 16 heads, 16
    keys a tile, one stage: as ``mla_config``."""
    block_h = 64 if num_heads >= 64 else 16
    if interpreting:
        return V4AttentionConfig(block_h=block_h, block_n=8, num_warps=4, num_stages=1, min_split=8)
    if element_size > 2:
        return V4AttentionConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_split=256)
    return V4AttentionConfig(
        block_h=block_h, block_n=32, num_warps=8 if block_h == 64 else 4, num_stages=2, min_split=256
    )


def v4_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    entries: torch.Tensor | None,
    window_tables: torch.Tensor,
    full_tables: torch.Tensor,
    token_seqs: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    entry_indices: torch.Tensor | None,
    sinks: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    window: int,
    rate: int | None,
    max_seq_len: int,
    num_splits: int | None = None,
    derotate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``out[t]`` = row ``t`` of ``query`` over its window and entries (see the module doc);
    ``entries`` None for a sliding layer, ``entry_indices`` None for HCA. ``num_splits``
    overrides how each token's keys are split (by default from the longest token's keys,
    which ``max_seq_len`` bounds). ``derotate``: ``(cos, sin)`` ``[num_tokens, pairs]``,
    contiguous rows, to leave the output de-rotated (the module doc)."""
    num_tokens, num_heads, head = query.shape
    if num_tokens == 0:
        return
    cos, sin = (sinks, sinks) if derotate is None else derotate  # never read without derotate
    rope_pairs = 0 if derotate is None else cos.shape[1]
    mode = NO_ENTRIES if entries is None else ALL_CLOSED if entry_indices is None else LISTED
    topk = 0 if entry_indices is None else entry_indices.shape[1]
    config = v4_attention_config(num_heads, interpreting=support.interpreting(), element_size=query.element_size())
    head_tiles = triton.cdiv(num_heads, config.block_h)
    if num_splits is None:
        longest = min(window, max_seq_len) + (topk if mode == LISTED else max_seq_len // (rate or 1))
        num_splits = choose_num_splits(num_tokens * head_tiles, longest, sm_count(query.device), config.min_split)
    split = num_splits > 1
    if split:
        part_out, part_lse = partial_buffers(num_tokens, num_heads, num_splits, head, query.device)
    else:  # never written
        part_out = part_lse = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    entries_arg = kv_cache if entries is None else entries  # never read without entries
    indices_arg = token_seqs if entry_indices is None else entry_indices
    v4_attention_kernel[(num_tokens, head_tiles, num_splits)](
        query,
        kv_cache,
        entries_arg,
        window_tables,
        full_tables,
        token_seqs,
        query_start_loc,
        seq_lens,
        indices_arg,
        sinks,
        cos,
        sin,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        num_heads,
        window,
        rate or 1,
        topk,
        num_splits,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        entries_arg.stride(0),
        entries_arg.stride(1),
        window_tables.stride(0),
        full_tables.stride(0),
        indices_arg.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        cos.stride(0),
        HEAD=head,
        HEAD_PAD=padded(head),
        BLOCK_SIZE=kv_cache.shape[1],
        ENTRIES_PER_BLOCK=entries_arg.shape[1],
        ENTRIES=mode,
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        SPLIT=split,
        DOT_F32=support.interpreting(),
        ROPE_PAIRS=rope_pairs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        combine_splits(part_out, part_lse, out)


_INTS = dict.fromkeys(
    (
        "num_heads",
        "window",
        "rate",
        "topk",
        "num_splits",
        "stride_qt",
        "stride_qh",
        "stride_kb",
        "stride_kt",
        "stride_eb",
        "stride_et",
        "stride_wt",
        "stride_ft",
        "stride_it",
        "stride_ot",
        "stride_oh",
        "stride_pt",
        "stride_ph",
        "stride_ps",
        "stride_st",
        "stride_sh",
        "stride_ct",
    ),
    "i32",
)


def aot_specs(capability: tuple[int, int], element_size: int = 2) -> list[dict]:
    """bf16 (float32 with ``element_size`` 4) DeepSeek-V4-Flash shapes (64 heads of 512,
    block size 128: CSA rate 4, HCA 128; the output de-rotated on its 64 rotary dims): a
    sliding layer whole, CSA split and HCA split."""
    types = {
        "q_ptr": "*bf16",
        "kv_ptr": "*bf16",
        "entries_ptr": "*bf16",
        "window_tables_ptr": "*i32",
        "full_tables_ptr": "*i32",
        "token_seqs_ptr": "*i32",
        "query_start_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "indices_ptr": "*i32",
        "sinks_ptr": "*fp32",
        "cos_ptr": "*bf16",
        "sin_ptr": "*bf16",
        "out_ptr": "*bf16",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "qk_scale": "fp32",
        **_INTS,
    }
    config = v4_attention_config(64, element_size=element_size)
    specs = []
    for name, mode, per_block, split in (
        ("sliding", NO_ENTRIES, 128, False),
        ("csa_split", LISTED, 32, True),
        ("hca_split", ALL_CLOSED, 1, True),
    ):
        constexprs = {
            "HEAD": 512,
            "HEAD_PAD": 512,
            "BLOCK_SIZE": 128,
            "ENTRIES_PER_BLOCK": per_block,
            "ENTRIES": mode,
            "BLOCK_H": config.block_h,
            "BLOCK_N": config.block_n,
            "SPLIT": split,
            "DOT_F32": False,
            "ROPE_PAIRS": 32,
        }
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        spec = aot_spec(
            f"v4_attention_{name}{fp32_suffix(element_size)}",
            v4_attention_kernel,
            typed(types, element_size),
            constexprs,
            options,
        )
        specs.append({**spec, "mma": config.block_h >= 64})
    return specs
