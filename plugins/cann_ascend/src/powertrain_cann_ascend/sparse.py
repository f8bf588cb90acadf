"""DeepSeek-V3.2's sparse attention and Lightning Indexer on ``torch_npu`` operators.

``npu_sparse_flash_attention`` (sparse MLA) and ``npu_lightning_indexer`` (scores and
top-k), as torch_npu documents them (Ascend/op-plugin ``docs/context``; the stand-ins in
``testing/standins/sparse.py`` name the pages and what else pinned the semantics down). How the engine's
step maps onto them:

* **One batch per token.** Both operators take TND queries with prefix-sum query
  lengths. Every new token is passed as its own one-query batch
  (``actual_seq_lengths_query = 1, 2, ..., T``) over its sequence's block table, with
  its own key length. With one query per batch, rightDownCausal (``sparse_mode=3``)
  masks nothing below that length, so the key length alone says what the token sees:
  the sequence's ``seq_len`` for sparse attention (the contract attends exactly what
  the indices list), and the token's visible key count ``(p + 1) // tokens_per_entry``
  for the indexer (V3.2's per-token keys and V4's compressed entries alike, with no
  compression argument). vllm-ascend drives the indexer the same way in decode.
* **Indices the operator can take.** Its documentation wants a row's valid indices
  first and ``-1`` after; the contract allows ``-1`` anywhere, so rows are compacted
  (a stable sort keeps the listed order). A row with no valid index (undocumented for
  the operator) is given position 0 and its output zeroed afterwards.
* **Indexer output.** The operator returns ``sparse_count`` columns per row, ``-1`` past
  the row's key count. A token with no visible key yet is given one key and its picks
  dropped, so every column the contract gets is a visible key or ``-1``.

Documented constraints this therefore requires: sparse attention with the MLA-absorb
widths (latent 512, rope 64, one KV head, up to 128 query heads, padded to a power of
two); the indexer with 64 heads of
128, query/key/weights of one dtype (the float32 head weights are rounded to it), and
top-k at most 2048. Both take block sizes a multiple of 16 up to 1024.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from powertrain.interfaces import AttentionMetadata

SPARSE_HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
INDEXER_HEADS, INDEXER_HEAD_DIM = 64, 128
MAX_TOPK = 2048


@attrs.frozen
class TokenBatches:
    """The step's new tokens, each its own one-query TND batch (built once per step).

    ``query_ends`` is ``1..T`` (prefix sums of one query each), ``block_table`` each
    token's sequence's row, ``seq_lens`` its sequence's length and ``positions`` its
    position in the sequence; all int32 on the metadata's device.
    """

    query_ends: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of(cls, metadata: AttentionMetadata) -> TokenBatches:
        device = metadata.seq_lens.device
        tokens = metadata.num_tokens
        sequences = metadata.token_sequences.long()
        positions = [
            position
            for context, query in zip(metadata.context_lens_host, metadata.query_lens_host, strict=True)
            for position in range(context, context + query)
        ]
        return cls(
            query_ends=torch.arange(1, tokens + 1, dtype=torch.int32, device=device),
            block_table=metadata.block_tables[sequences].to(torch.int32).contiguous(),
            seq_lens=metadata.seq_lens[sequences].to(torch.int32),
            positions=torch.tensor(positions, dtype=torch.int32, device=device),
        )


def sparse_padded_heads(num_heads: int) -> int:
    """The head count the sparse operator is called with: the next power of two (<= 128)."""
    for count in SPARSE_HEAD_COUNTS:
        if num_heads <= count:
            return count
    raise ValueError(
        f"ascend-cann: npu_sparse_flash_attention takes at most {SPARSE_HEAD_COUNTS[-1]} query heads, the layer "
        f"has {num_heads} (shard heads over more ranks)"
    )


def compact_indices(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows the operator takes, rows that list nothing)``: each row's valid indices first
    in their order, -1 after; a row of only -1 gets position 0 (its output is dropped)."""
    order = (indices == -1).to(torch.int8).argsort(dim=-1, stable=True)
    compact = indices.gather(-1, order)
    empty = compact[:, 0] == -1
    compact[:, 0] = torch.where(empty, torch.zeros_like(compact[:, 0]), compact[:, 0])
    return compact.contiguous(), empty


def sparse_attention_args(batches: TokenBatches, scale: float) -> dict[str, Any]:
    """Keyword arguments of the sparse call besides the tensors (see the module doc)."""
    return {
        "scale_value": scale,
        "block_table": batches.block_table,
        "actual_seq_lengths_query": batches.query_ends,
        "actual_seq_lengths_kv": batches.seq_lens,
        "sparse_block_size": 1,
        "layout_query": "TND",
        "layout_kv": "PA_BSND",
        "sparse_mode": 3,
        "attention_mode": 2,
    }


def visible_keys(batches: TokenBatches, tokens_per_entry: int) -> torch.Tensor:
    """int32 ``[T]``: the keys each token may pick, ``(p + 1) // tokens_per_entry``."""
    return torch.div(batches.positions + 1, tokens_per_entry, rounding_mode="floor")


def indexer_args(batches: TokenBatches, visible: torch.Tensor, width: int) -> dict[str, Any]:
    """Keyword arguments of the indexer call besides the tensors; a token with no visible
    key yet is given one (its pick is dropped by ``visible_picks``)."""
    if width > MAX_TOPK:
        raise ValueError(
            f"ascend-cann: npu_lightning_indexer keeps at most {MAX_TOPK} keys per row (sparse_count), the model "
            f"asks for {width}; run this model on a backend without that limit (torch-reference, triton-sm100)"
        )
    return {
        "actual_seq_lengths_query": batches.query_ends,
        "actual_seq_lengths_key": visible.clamp(min=1),
        "block_table": batches.block_table,
        "layout_query": "TND",
        "layout_key": "PA_BSND",
        "sparse_count": width,
        "sparse_mode": 3,
    }


def visible_picks(picked: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The operator's ``[T, 1, width]`` picks as the contract's int32 ``[T, width]``: any
    column that is not a visible key becomes -1."""
    rows = picked[:, 0].to(torch.int32)
    return torch.where((rows >= 0) & (rows < visible[:, None]), rows, torch.full_like(rows, -1))


def check_indexer_widths(query: torch.Tensor) -> None:
    if tuple(query.shape[1:]) != (INDEXER_HEADS, INDEXER_HEAD_DIM):
        raise ValueError(
            f"ascend-cann: npu_lightning_indexer takes {INDEXER_HEADS} index heads of {INDEXER_HEAD_DIM} "
            f"(DeepSeek-V3.2/V4 shapes), the query is {tuple(query.shape)}; serve this model's indexer with a "
            "backend without that limit"
        )
