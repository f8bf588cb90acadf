"""Multi-head latent attention, weight-absorbed, over the compressed latent cache.

The cache holds per token only the latent (``kv_lora_rank``) and the rotated rope
key (``qk_rope_head_dim``), each ``[num_blocks, block_size, width]``. Every query
head scores ``scale * (q_latent·latent + q_rope·k_rope)`` and averages the latent
itself, so the latent tile a program loads serves as key and as value, and all
heads share it: a program takes ``BLOCK_H`` heads of ``BLOCK_Q`` tokens of one
sequence (rows are (token, head) pairs) and reads each latent tile once for them.

One kernel serves any number of new tokens per sequence, causally (decode, chunked
prefill, verification). Decode is bound by reading the latent cache, so decode
launches cut each sequence's keys into splits like GQA decode
(``split_kv.combine_splits`` merges them); prefill launches, with many rows per
sequence, fill the GPU without splitting.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support
from powertrain_cuda_sm100.kernels.common import aot_spec, choose_num_splits, fp32_suffix, mma, padded, sm_count, typed
from powertrain_cuda_sm100.kernels.split_kv import combine_splits, partial_buffers

LOG2E = 1.4426950408889634


@triton.jit
def latent_tile(
    q_lat,
    q_rope,
    lat,
    k_rope,
    visible,
    m,
    total,
    acc,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One key tile of absorbed MLA's online softmax (base 2): the rows' scores
    ``q_rope·k_rope + q_lat·lat`` (keys not ``visible`` weigh nothing) folded into the
    running max ``m``, sum ``total`` and latent accumulator ``acc``; the latent tile is
    key and value. Returns the three updated."""
    scores = mma(q_rope, tl.trans(k_rope), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_F32)
    scores = mma(q_lat, tl.trans(lat), scores, DOT_F32) * qk_scale
    return shared_kv_softmax_tile(scores, lat, visible, m, total, acc, DOT_F32)


@triton.jit
def shared_kv_softmax_tile(scores, kv, visible, m, total, acc, DOT_F32: tl.constexpr):
    """One tile of an online softmax (base-2 ``scores``) whose key tile ``kv`` is also the
    value tile (absorbed MLA's latent, V4's shared K=V head): keys not ``visible`` weigh
    nothing. Returns the running max ``m``, sum ``total`` and accumulator ``acc``, updated."""
    scores = tl.where(visible, scores, -float("inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that see nothing yet gain zeros
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    total = total * alpha + tl.sum(p, 1)
    acc = mma(p.to(kv.dtype), kv, acc * alpha[:, None], DOT_F32)
    return m_new, total, acc


@triton.jit
def store_latent_rows(
    out_rows,  # per row: its output row (written when not SPLIT)
    part_rows,  # per row: its split's float32 partial row (SPLIT)
    lse_rows,  # per row: its split's log-sum-exp (SPLIT)
    m,
    total,
    acc,
    rank,
    row_ok,
    rank_ok,
    SPLIT: tl.constexpr,
):
    """The rows' latent outputs (zeros for a row that saw no key), or with ``SPLIT`` the
    split's partial rows and log-sum-exps for ``split_kv.combine_splits``."""
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    out_mask = row_ok[:, None] & rank_ok[None, :]
    if SPLIT:
        lse = tl.where(seen, m + tl.log2(tl.where(seen, total, 1.0)), -float("inf"))
        tl.store(part_rows[:, None] + rank[None, :], out, mask=out_mask)
        tl.store(lse_rows, lse, mask=row_ok)
    else:
        tl.store(out_rows[:, None] + rank[None, :], out.to(out_rows.dtype.element_ty), mask=out_mask)


@triton.jit
def mla_kernel(
    q_latent_ptr,  # [num_tokens, heads, rank]
    q_rope_ptr,  # [num_tokens, heads, rope]
    latent_ptr,  # [num_blocks, block_size, rank]
    rope_ptr,  # [num_blocks, block_size, rope]
    block_tables_ptr,  # int32 [batch, max_blocks]
    seq_lens_ptr,  # int32 [batch]
    query_start_loc_ptr,  # int32 [batch + 1]
    out_ptr,  # [num_tokens, heads, rank] (written when not SPLIT)
    part_out_ptr,  # float32 [num_tokens, heads, splits, rank] (written when SPLIT)
    part_lse_ptr,  # float32 [num_tokens, heads, splits]
    qk_scale,  # softmax scale * log2(e)
    window,  # read when SLIDING
    first_seq,
    num_heads,
    num_splits,
    stride_qlt,
    stride_qlh,
    stride_qrt,
    stride_qrh,
    stride_lb,
    stride_lt,
    stride_rb,
    stride_rt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_st,
    stride_sh,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_Q: tl.constexpr,  # tokens per program
    BLOCK_N: tl.constexpr,  # keys per tile
    SLIDING: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    seq = first_seq + tl.program_id(0)
    head_tiles = tl.cdiv(num_heads, BLOCK_H)
    q_tile = tl.program_id(1) // head_tiles
    head_tile = tl.program_id(1) % head_tiles
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // BLOCK_H
    head = head_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (token < q_len) & (head < num_heads)
    position = context + token
    flat_token = (q_start + token).to(tl.int64)
    rank = tl.arange(0, RANK_PAD)
    rank_ok = rank < RANK
    rope = tl.arange(0, ROPE_PAD)
    rope_ok = rope < ROPE
    q_lat = tl.load(
        q_latent_ptr + (flat_token * stride_qlt + head * stride_qlh)[:, None] + rank[None, :],
        mask=row_ok[:, None] & rank_ok[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + (flat_token * stride_qrt + head * stride_qrh)[:, None] + rope[None, :],
        mask=row_ok[:, None] & rope_ok[None, :],
        other=0.0,
    )

    # The keys this tile's rows can see, then this program's split of them.
    end = tl.minimum(context + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q), seq_len)
    start = 0
    if SLIDING:
        start = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    start = start + split * per_split
    end = tl.minimum(start + per_split, end)

    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        lat = tl.load(
            (latent_ptr + block * stride_lb + offset * stride_lt)[:, None] + rank[None, :],
            mask=key_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )
        k_rope = tl.load(
            (rope_ptr + block * stride_rb + offset * stride_rt)[:, None] + rope[None, :],
            mask=key_ok[:, None] & rope_ok[None, :],
            other=0.0,
        )
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
        if SLIDING:
            visible &= keys[None, :] > position[:, None] - window
        m, total, acc = latent_tile(
            q_lat, q_rope, lat, k_rope, visible, m, total, acc, qk_scale, BLOCK_M, BLOCK_N, DOT_F32
        )

    store_latent_rows(
        out_ptr + flat_token * stride_ot + head * stride_oh,
        part_out_ptr + flat_token * stride_pt + head * stride_ph + split * stride_ps,
        part_lse_ptr + flat_token * stride_st + head * stride_sh + split,
        m,
        total,
        acc,
        rank,
        row_ok,
        rank_ok,
        SPLIT,
    )


@attrs.frozen
class MLAConfig:
    block_h: int  # heads per program
    block_q: int  # tokens per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    min_split: int  # fewest keys worth a split (decode)


def mla_config(
    capability: tuple[int, int], num_heads: int, decode: bool, interpreting: bool = False, element_size: int = 2
) -> MLAConfig:
    """Tile and launch sizes per target and phase.

    A program's rows are 64 (token, head) pairs where the heads allow it: the M of a
    tensor-core MMA (tcgen05 on SM100, one wgmma warpgroup on SM90); 64 x
    kv_lora_rank float32 (512 in DeepSeek) is also about the most accumulator a
    program holds. Decode has one token per sequence, so with fewer than 64 heads per
    rank it takes 16 heads (the smallest M a dot takes, warp-level MMA) rather than
    pad rows; its keys are split. Float32 (``element_size`` 4) takes 16 rows, 16 keys a
    tile and one stage: its 64-row tiles would need about 490 KiB of shared memory
    (``test_aot`` checks every spec). Under the interpreter the key tiles are small so
    the tests cross several tiles and splits.
    """
    if decode:
        block_h, block_q = (64, 1) if num_heads >= 64 else (16, 1)
    else:
        block_h = min(64, max(1, triton.next_power_of_2(num_heads)))
        block_q = 64 // block_h
    num_warps = 8 if block_h * block_q >= 64 else 4
    if interpreting:
        return MLAConfig(block_h=block_h, block_q=block_q, block_n=16, num_warps=4, num_stages=1, min_split=16)
    if element_size > 2:
        return MLAConfig(block_h=min(block_h, 16), block_q=1, block_n=16, num_warps=4, num_stages=1, min_split=256)
    return MLAConfig(block_h=block_h, block_q=block_q, block_n=32, num_warps=num_warps, num_stages=2, min_split=256)


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    decode: bool,
    sliding_window: int | None = None,
    capability: tuple[int, int] = (10, 0),
    num_splits: int | None = None,
) -> None:
    """Absorbed MLA for sequences ``first_seq ... first_seq + num_seqs - 1``: their rows
    of ``q_latent``/``q_rope`` (per ``query_start_loc``) attend causally over their
    cached latent and rope keys; their rows of ``out`` get the latent outputs.

    ``decode`` (every sequence has one new token) selects decode tiles and split-KV;
    ``max_query_len``/``max_seq_len`` are host ints over these sequences;
    ``num_splits`` overrides the choice (decode only).
    """
    if num_seqs == 0:
        return
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    interpreting = support.interpreting()
    config = mla_config(capability, num_heads, decode, interpreting=interpreting, element_size=q_latent.element_size())
    head_tiles = triton.cdiv(num_heads, config.block_h)
    if not decode:
        num_splits = 1
    elif num_splits is None:
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs * head_tiles, span, sm_count(q_latent.device), config.min_split)
    split = num_splits > 1
    if split:
        part_out, part_lse = partial_buffers(num_tokens, num_heads, num_splits, rank, q_latent.device)
    else:  # never written
        part_out = part_lse = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    grid = (num_seqs, triton.cdiv(max_query_len, config.block_q) * head_tiles, num_splits)
    mla_kernel[grid](
        q_latent,
        q_rope,
        latent_cache,
        rope_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        sliding_window or 0,
        first_seq,
        num_heads,
        num_splits,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        rope_cache.stride(0),
        rope_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        RANK=rank,
        RANK_PAD=padded(rank),
        ROPE=rope,
        ROPE_PAD=padded(rope),
        BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_H=config.block_h,
        BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n,
        SLIDING=sliding_window is not None,
        SPLIT=split,
        DOT_F32=interpreting,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        combine_splits(part_out, part_lse, out)


_INTS = dict.fromkeys(
    (
        "window",
        "first_seq",
        "num_heads",
        "num_splits",
        "stride_qlt",
        "stride_qlh",
        "stride_qrt",
        "stride_qrh",
        "stride_lb",
        "stride_lt",
        "stride_rb",
        "stride_rt",
        "stride_bt",
        "stride_ot",
        "stride_oh",
        "stride_pt",
        "stride_ph",
        "stride_ps",
        "stride_st",
        "stride_sh",
    ),
    "i32",
)


def aot_specs(capability: tuple[int, int], element_size: int = 2) -> list[dict]:
    """bf16 (float32 with ``element_size`` 4) DeepSeek-V3 shapes (kv_lora_rank 512, rope 64,
    block size 64): decode with 16 heads per rank (TP8) split and not, with 128 heads (TP1),
    and prefill."""
    types = {
        "q_latent_ptr": "*bf16",
        "q_rope_ptr": "*bf16",
        "latent_ptr": "*bf16",
        "rope_ptr": "*bf16",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "out_ptr": "*bf16",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "qk_scale": "fp32",
        **_INTS,
    }
    specs = []
    for heads, decode, split in ((16, True, False), (16, True, True), (128, True, True), (16, False, False)):
        config = mla_config(capability, heads, decode, element_size=element_size)
        constexprs = {
            "RANK": 512,
            "RANK_PAD": 512,
            "ROPE": 64,
            "ROPE_PAD": 64,
            "BLOCK_SIZE": 64,
            "BLOCK_H": config.block_h,
            "BLOCK_Q": config.block_q,
            "BLOCK_N": config.block_n,
            "SLIDING": False,
            "SPLIT": split,
            "DOT_F32": False,
        }
        name = f"mla_{'decode' if decode else 'prefill'}_h{heads}{'_split' if split else ''}{fp32_suffix(element_size)}"
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        # 64-row tiles (many heads, or prefill) use tensor-core MMA; 16-head decode tiles
        # are too small for it and read-bound anyway (warp-level mma.sync).
        mma = config.block_h * config.block_q >= 64
        specs.append({**aot_spec(name, mla_kernel, typed(types, element_size), constexprs, options), "mma": mma})
    return specs
