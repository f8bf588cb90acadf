"""The Lightning Indexer's scores (DeepSeek-V3.2's DSA, V4's CSA), over the paged key cache.

Query token ``t`` scores each key ``s`` its sequence holds as
``sum_h w[t, h] * ReLU(q[t, h] . k[s])`` (``LightningIndexerBackend``). At long context this
is most of DSA's cost: every query reads every cached key. A program takes one query token
and ``BLOCK_N`` keys: it gathers the key tile through the sequence's block table, multiplies
it with all the token's heads at once (one MMA), and reduces the heads into one score per
key. Keys the token cannot see yet (``s >= (p + 1) // tokens_per_entry``) score ``-inf``,
so a ``torch.topk`` over the row picks the visible ones first.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support
from powertrain_cuda_sm100.kernels.common import aot_spec, mma, padded, paged_rows


@triton.jit
def index_scores_kernel(
    q_ptr,  # [rows, heads, dim]: the step's tokens first_token, first_token + 1, ...
    weights_ptr,  # float32 [rows, heads]
    keys_ptr,  # [num_blocks, per_block, dim]
    tables_ptr,  # int32 [batch, max_blocks]
    token_seqs_ptr,  # int32 [rows]: each row's sequence
    query_start_ptr,  # int32 [batch + 1]
    seq_lens_ptr,  # int32 [batch]
    scores_ptr,  # float32 [rows, columns]
    first_token,  # the step token of row 0
    num_heads,
    columns,
    tokens_per_entry,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kb,
    stride_kt,
    stride_bt,
    stride_st,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,  # every head, padded
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq = tl.load(token_seqs_ptr + row).to(tl.int64)
    position = tl.load(seq_lens_ptr + seq) - (tl.load(query_start_ptr + seq + 1) - (first_token + row))
    visible = column < (position + 1) // tokens_per_entry
    head = tl.arange(0, BLOCK_H)
    head_ok = head < num_heads
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < DIM
    q = tl.load(
        q_ptr + (row * stride_qt + head * stride_qh)[:, None] + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    weights = tl.load(weights_ptr + row * stride_wt + head, mask=head_ok, other=0.0)
    keys = paged_rows(
        keys_ptr, tables_ptr + seq * stride_bt, column, visible, PER_BLOCK, stride_kb, stride_kt, dims, dim_ok
    )
    per_head = tl.maximum(mma(q, tl.trans(keys), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_F32), 0.0)
    scores = tl.sum(weights[:, None] * per_head, 0)
    tl.store(scores_ptr + row * stride_st + column, tl.where(visible, scores, -float("inf")), mask=column < columns)


@attrs.frozen
class IndexerConfig:
    block_n: int  # keys per program
    num_warps: int
    num_stages: int


def indexer_config(interpreting: bool = False) -> IndexerConfig:
    """Small key tiles under the interpreter, so the tests cross several tiles and blocks."""
    if interpreting:
        return IndexerConfig(block_n=8, num_warps=4, num_stages=1)
    return IndexerConfig(block_n=64, num_warps=4, num_stages=2)


def index_scores(
    query: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    block_tables: torch.Tensor,
    token_seqs: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    columns: int,
    tokens_per_entry: int,
    first_token: int = 0,
) -> torch.Tensor:
    """float32 ``[rows, columns]``: for the step's tokens ``first_token ..`` (``query``'s rows,
    ``token_seqs`` their sequences), each one's score for keys ``0 .. columns - 1`` of its
    sequence, ``-inf`` for those it cannot see (see the module doc)."""
    num_tokens, num_heads, dim = query.shape
    scores = torch.empty((num_tokens, columns), dtype=torch.float32, device=query.device)
    if num_tokens == 0 or columns == 0:
        return scores
    config = indexer_config(interpreting=support.interpreting())
    index_scores_kernel[(num_tokens, triton.cdiv(columns, config.block_n))](
        query,
        weights,
        keys,
        block_tables,
        token_seqs,
        query_start_loc,
        seq_lens,
        scores,
        first_token,
        num_heads,
        columns,
        tokens_per_entry,
        query.stride(0),
        query.stride(1),
        weights.stride(0),
        keys.stride(0),
        keys.stride(1),
        block_tables.stride(0),
        scores.stride(0),
        DIM=dim,
        DIM_PAD=padded(dim),
        PER_BLOCK=keys.shape[1],
        BLOCK_H=padded(num_heads),
        BLOCK_N=config.block_n,
        DOT_F32=support.interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return scores


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """bf16 DeepSeek-V3.2 / V4 indexer shapes (64 heads of 128): V3.2's per-token keys in
    blocks of 64, V4's CSA entries (rate 4) in blocks of 128 tokens."""
    types = {
        "q_ptr": "*bf16",
        "weights_ptr": "*fp32",
        "keys_ptr": "*bf16",
        "tables_ptr": "*i32",
        "token_seqs_ptr": "*i32",
        "query_start_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "scores_ptr": "*fp32",
        **dict.fromkeys(
            (
                "first_token",
                "num_heads",
                "columns",
                "tokens_per_entry",
                "stride_qt",
                "stride_qh",
                "stride_wt",
                "stride_kb",
                "stride_kt",
                "stride_bt",
                "stride_st",
            ),
            "i32",
        ),
    }
    config = indexer_config()
    specs = []
    for name, per_block in (("v32", 64), ("v4_csa", 32)):
        constexprs = {
            "DIM": 128,
            "DIM_PAD": 128,
            "PER_BLOCK": per_block,
            "BLOCK_H": 64,
            "BLOCK_N": config.block_n,
            "DOT_F32": False,
        }
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        specs.append({**aot_spec(f"index_scores_{name}", index_scores_kernel, types, constexprs, options), "mma": True})
    return specs
