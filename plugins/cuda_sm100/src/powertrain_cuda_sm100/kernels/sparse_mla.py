"""Sparse MLA (DeepSeek-V3.2's DSA): each query token attends only to the cached tokens
its row of ``indices`` lists, over the paged latent cache, weight-absorbed as ``mla.py``.

The listed positions differ from token to token, so a program serves one query token
and ``BLOCK_H`` of its heads, which share the token's list: each latent tile it gathers
(positions -> block table -> slots) serves every one of those heads as key and as value.
``-1`` entries are padding wherever they sit; the positions are attended as listed, with
no causal mask (the indexer chose visible tokens). A row that lists nothing outputs
zeros. Positions out of range are refused before the launch
(``AttentionMetadata.refuse_sparse_indices`` reads them as padding), so the kernel never
reads past a table.

Decode batches have few tokens, and a top-k list of 2048 keeps one program busy long
after the others finished, so decode-sized launches split each list like split-KV decode
(``split_kv.combine_splits`` merges the parts).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support
from powertrain_cuda_sm100.kernels.common import aot_spec, choose_num_splits, fp32_suffix, padded, sm_count, typed
from powertrain_cuda_sm100.kernels.mla import latent_tile, store_latent_rows
from powertrain_cuda_sm100.kernels.split_kv import combine_splits, partial_buffers

LOG2E = 1.4426950408889634


@triton.jit
def sparse_mla_kernel(
    q_latent_ptr,  # [num_tokens, heads, rank]
    q_rope_ptr,  # [num_tokens, heads, rope]
    latent_ptr,  # [num_blocks, block_size, rank]
    rope_ptr,  # [num_blocks, block_size, rope]
    block_tables_ptr,  # int32 [batch, max_blocks]
    token_seqs_ptr,  # int32 [num_tokens]: each query row's sequence
    indices_ptr,  # int32 [num_tokens, topk]: positions within the sequence, -1 padding
    out_ptr,  # [num_tokens, heads, rank] (written when not SPLIT)
    part_out_ptr,  # float32 [num_tokens, heads, splits, rank] (written when SPLIT)
    part_lse_ptr,  # float32 [num_tokens, heads, splits]
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    topk,
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
    stride_it,
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
    BLOCK_N: tl.constexpr,  # listed positions per tile
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < num_heads
    seq = tl.load(token_seqs_ptr + token).to(tl.int64)
    rank = tl.arange(0, RANK_PAD)
    rank_ok = rank < RANK
    rope = tl.arange(0, ROPE_PAD)
    rope_ok = rope < ROPE
    q_lat = tl.load(
        q_latent_ptr + (token * stride_qlt + head * stride_qlh)[:, None] + rank[None, :],
        mask=head_ok[:, None] & rank_ok[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + (token * stride_qrt + head * stride_qrh)[:, None] + rope[None, :],
        mask=head_ok[:, None] & rope_ok[None, :],
        other=0.0,
    )

    # This program's split of the token's list.
    per_split = tl.cdiv(tl.cdiv(topk, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, topk)

    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    listed = indices_ptr + token * stride_it
    for tile in range(start, end, BLOCK_N):
        columns = tile + tl.arange(0, BLOCK_N)
        position = tl.load(listed + columns, mask=columns < end, other=-1)
        key_ok = position >= 0
        position = tl.where(key_ok, position, 0)
        block = tl.load(table + position // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = position % BLOCK_SIZE
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
        visible = tl.broadcast_to(key_ok[None, :], (BLOCK_H, BLOCK_N))
        m, total, acc = latent_tile(
            q_lat, q_rope, lat, k_rope, visible, m, total, acc, qk_scale, BLOCK_H, BLOCK_N, DOT_F32
        )

    store_latent_rows(
        out_ptr + token * stride_ot + head * stride_oh,
        part_out_ptr + token * stride_pt + head * stride_ph + split * stride_ps,
        part_lse_ptr + token * stride_st + head * stride_sh + split,
        m,
        total,
        acc,
        rank,
        head_ok,
        rank_ok,
        SPLIT,
    )


@attrs.frozen
class SparseMLAConfig:
    block_h: int  # heads per program
    block_n: int  # listed positions per tile
    num_warps: int
    num_stages: int
    min_split: int  # fewest listed positions worth a split


def sparse_mla_config(num_heads: int, interpreting: bool = False, element_size: int = 2) -> SparseMLAConfig:
    """Tile and launch sizes. A program's rows are one token's heads: 64 where the layer
    has them (the M of a tensor-core MMA), else 16 (the smallest M a dot takes; a rank of
    TP8 DeepSeek holds 16 heads), whose tiles are read-bound anyway. Under the
    interpreter the tiles are small so the tests cross several tiles and splits. Float32
    (``element_size`` 4) takes 16 heads, 16 positions a tile, one stage: as ``mla_config``."""
    block_h = 64 if num_heads >= 64 else 16
    if interpreting:
        return SparseMLAConfig(block_h=block_h, block_n=16, num_warps=4, num_stages=1, min_split=16)
    if element_size > 2:
        return SparseMLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_split=256)
    return SparseMLAConfig(
        block_h=block_h, block_n=32, num_warps=8 if block_h == 64 else 4, num_stages=2, min_split=256
    )


def sparse_mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seqs: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
) -> None:
    """Each row ``t`` of ``q_latent``/``q_rope`` attends to the positions ``indices[t]``
    lists of sequence ``token_seqs[t]`` (out-of-range ones already read as -1); ``out[t]`` gets the
    latent output. ``num_splits`` overrides how the lists are split."""
    num_tokens, num_heads, rank = q_latent.shape
    if num_tokens == 0:
        return
    rope, topk = q_rope.shape[2], indices.shape[1]
    config = sparse_mla_config(num_heads, interpreting=support.interpreting(), element_size=q_latent.element_size())
    head_tiles = triton.cdiv(num_heads, config.block_h)
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens * head_tiles, topk, sm_count(q_latent.device), config.min_split)
    split = num_splits > 1
    if split:
        part_out, part_lse = partial_buffers(num_tokens, num_heads, num_splits, rank, q_latent.device)
    else:  # never written
        part_out = part_lse = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    sparse_mla_kernel[(num_tokens, head_tiles, num_splits)](
        q_latent,
        q_rope,
        latent_cache,
        rope_cache,
        block_tables,
        token_seqs,
        indices,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        num_heads,
        topk,
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
        indices.stride(0),
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
        BLOCK_N=config.block_n,
        SPLIT=split,
        DOT_F32=support.interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        combine_splits(part_out, part_lse, out)


_INTS = dict.fromkeys(
    (
        "num_heads",
        "topk",
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
        "stride_it",
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
    """bf16 (float32 with ``element_size`` 4) DeepSeek-V3.2 shapes (kv_lora_rank 512, rope
    64, block size 64): 16 heads per rank (TP8) whole and split, and 128 heads (TP1) split."""
    types = {
        "q_latent_ptr": "*bf16",
        "q_rope_ptr": "*bf16",
        "latent_ptr": "*bf16",
        "rope_ptr": "*bf16",
        "block_tables_ptr": "*i32",
        "token_seqs_ptr": "*i32",
        "indices_ptr": "*i32",
        "out_ptr": "*bf16",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "qk_scale": "fp32",
        **_INTS,
    }
    specs = []
    for heads, split in ((16, False), (16, True), (128, True)):
        config = sparse_mla_config(heads, element_size=element_size)
        constexprs = {
            "RANK": 512,
            "RANK_PAD": 512,
            "ROPE": 64,
            "ROPE_PAD": 64,
            "BLOCK_SIZE": 64,
            "BLOCK_H": config.block_h,
            "BLOCK_N": config.block_n,
            "SPLIT": split,
            "DOT_F32": False,
        }
        name = f"sparse_mla_h{heads}{'_split' if split else ''}{fp32_suffix(element_size)}"
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        # 64-head tiles use tensor-core MMA; 16-head tiles are too small for it (mma.sync).
        spec = aot_spec(name, sparse_mla_kernel, typed(types, element_size), constexprs, options)
        specs.append({**spec, "mma": config.block_h >= 64})
    return specs
