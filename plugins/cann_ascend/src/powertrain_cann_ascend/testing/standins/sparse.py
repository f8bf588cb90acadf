"""Stand-ins for the DeepSeek-V3.2 operators the attention backend calls (no NPU here).

``SparseAttentionStandIn`` is NOT torch_npu: it is plain torch written from the
operators' documentation, for the argument combinations the backend uses (TND queries,
a paged ``PA_BSND`` cache, ``sparse_block_size`` 1), refusing anything else by name:

* ``torch_npu.npu_sparse_flash_attention``: Ascend/op-plugin
  ``docs/context/torch_npu-npu_sparse_flash_attention.md`` (signature, three outputs,
  ``attention_mode=2`` only, a row's valid indices first and invalid ones after, outputs
  in the query's dtype), with CANN ops-transformer's
  ``attention/sparse_flash_attention/README.md`` and the CPU golden function of the
  operator's own test (``tests/python/sgl_kernel_npu/test_sparse_flash_attention.py`` in
  sgl-kernel-npu) for what the prose leaves out: a ``-1`` ends a row's list;
  ``sparse_mode=3`` (rightDownCausal) masks a listed position ``>= kv_len - q_len + i + 1``
  for the ``i``-th query row of a batch; value is the key (MLA-absorb).
* ``torch_npu.npu_lightning_indexer``: Ascend/op-plugin
  ``docs/context/torch_npu-npu_lightning_indexer.md`` (query, key and weights of one
  dtype; 64 heads of 128; ``sparse_count`` 1..2048; two outputs), with the CPU golden
  function of ``test_lightning_indexer.py`` (same repository as above): scores
  ``sum_h W * ReLU(Q K^T)``, rightDownCausal masking, the best ``sparse_count`` per row,
  ``-1`` in an output row's columns past its key count.

What the documentation does not pin down is refused here rather than guessed: a row
whose valid indices do not all come before its first ``-1``, a row with no valid index,
an index at or past its batch's key length, and an indexer row with fewer visible keys
than ``sparse_count`` (the golden function would hand back masked positions there). The
backend's mapping is built so none of these reach the operator.
"""

from __future__ import annotations

import math
from typing import Any

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
#: Query heads the sparse operator takes; its widths (MLA-absorb: latent and rope).
SFA_HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
SFA_LATENT_DIM, SFA_ROPE_DIM = 512, 64
#: The indexer's query heads and head width.
INDEXER_HEADS, INDEXER_DIM = 64, 128
MAX_SPARSE_COUNT = 2048
MAX_INT64 = 2**63 - 1


class SparseAttentionStandIn:
    """A stand-in for the ``torch_npu`` module: the sparse attention and indexer operators.

    ``sparse_calls`` records each call (operator name and keyword arguments without the
    big tensors) so tests can check the mapping."""

    def __init__(self) -> None:
        self.sparse_calls: list[tuple[str, dict[str, Any]]] = []

    def _record_sparse(self, operator: str, query: torch.Tensor, **arguments: Any) -> None:
        """One call in ``sparse_calls``: the query's shape and the arguments, tensors as host lists."""
        host = {k: _host(v) if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}
        self.sparse_calls.append((operator, {"query_shape": tuple(query.shape), **host}))

    # ----------------------------------------------------------------------- sparse attention

    def npu_sparse_flash_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sparse_indices: torch.Tensor,
        scale_value: float,
        *,
        block_table: torch.Tensor | None = None,
        actual_seq_lengths_query: torch.Tensor | None = None,
        actual_seq_lengths_kv: torch.Tensor | None = None,
        query_rope: torch.Tensor | None = None,
        key_rope: torch.Tensor | None = None,
        sparse_block_size: int = 1,
        layout_query: str = "BSND",
        layout_kv: str = "BSND",
        sparse_mode: int = 3,
        pre_tokens: int = MAX_INT64,
        next_tokens: int = MAX_INT64,
        attention_mode: int = 0,
        return_softmax_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(attention_out, softmax_max, softmax_sum)``; the last two are empty without
        ``return_softmax_lse`` (inference with a paged cache does not support it)."""
        self._record_sparse(
            "npu_sparse_flash_attention",
            query,
            layout_query=layout_query,
            layout_kv=layout_kv,
            sparse_mode=sparse_mode,
            sparse_block_size=sparse_block_size,
            actual_seq_lengths_query=actual_seq_lengths_query,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
        )
        # The NotImplementedError refusals here are deliberate, not gaps: the backend never
        # passes these arguments, and a stand-in guessing their semantics would let a mapping
        # that started passing them compute something plausible instead of failing here.
        if (layout_query, layout_kv) != ("TND", "PA_BSND"):
            raise NotImplementedError(f"stand-in: layouts {layout_query}/{layout_kv} (served: TND / PA_BSND)")
        if sparse_block_size != 1:
            raise NotImplementedError(f"stand-in: sparse_block_size={sparse_block_size} (served: 1)")
        if (pre_tokens, next_tokens) != (MAX_INT64, MAX_INT64):
            raise NotImplementedError("stand-in: pre_tokens/next_tokens are not served")
        if attention_mode != 2 or query_rope is None or key_rope is None:
            raise ValueError("only attention_mode=2 (MLA-absorb) is supported, and it needs query_rope and key_rope")
        if return_softmax_lse:
            raise ValueError("return_softmax_lse is supported only in training and not with layout_kv PA_BSND")
        if sparse_mode not in (0, 3):
            raise ValueError(f"sparse_mode must be 0 (all) or 3 (rightDownCausal), got {sparse_mode}")
        _check_half("query", query, key, value, query_rope, key_rope)
        if value.data_ptr() != key.data_ptr() or value.shape != key.shape:
            raise NotImplementedError("stand-in: MLA-absorb with value other than key")

        tokens, heads, dim = _dims("query", query, 3)
        if heads not in SFA_HEAD_COUNTS or dim != SFA_LATENT_DIM:
            raise ValueError(f"query must be [T, N1 in {SFA_HEAD_COUNTS}, {SFA_LATENT_DIM}], got {tuple(query.shape)}")
        if tuple(query_rope.shape) != (tokens, heads, SFA_ROPE_DIM):
            raise ValueError(f"query_rope must be {(tokens, heads, SFA_ROPE_DIM)}, got {tuple(query_rope.shape)}")
        blocks, block_size = _paged_key("key", key, SFA_LATENT_DIM)
        if tuple(key_rope.shape) != (blocks, block_size, 1, SFA_ROPE_DIM):
            raise ValueError(f"key_rope must be {(blocks, block_size, 1, SFA_ROPE_DIM)}, got {tuple(key_rope.shape)}")
        if sparse_indices.dtype != torch.int32 or sparse_indices.dim() != 3 or sparse_indices.shape[:2] != (tokens, 1):
            raise ValueError(f"sparse_indices must be int32 [T={tokens}, 1, sparse_size], got {sparse_indices.dtype} "
                             f"{tuple(sparse_indices.shape)}")  # fmt: skip
        q_starts, q_lens = _tnd_batches(actual_seq_lengths_query, tokens)
        kv_lens = _lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, len(q_lens))
        _check_block_table(block_table, kv_lens, block_size)

        out = torch.zeros((tokens, heads, SFA_LATENT_DIM), dtype=torch.float32, device=query.device)
        latent_rows = key.reshape(-1, SFA_LATENT_DIM)
        rope_rows = key_rope.reshape(-1, SFA_ROPE_DIM)
        for b, (start, q_len, kv_len) in enumerate(zip(q_starts, q_lens, kv_lens, strict=True)):
            for i in range(q_len):
                row = start + i
                listed = _listed(sparse_indices[row, 0], row, kv_len)
                slots = block_table[b, listed // block_size].long() * block_size + listed % block_size
                latent, rope = latent_rows[slots].float(), rope_rows[slots].float()
                scores = scale_value * (query[row].float() @ latent.T + query_rope[row].float() @ rope.T)
                if sparse_mode == 3:  # rightDownCausal: row i of q_len sees positions < kv_len - q_len + i + 1
                    scores = scores.masked_fill(listed[None, :] >= kv_len - q_len + i + 1, float("-inf"))
                out[row] = torch.softmax(scores, dim=-1) @ latent
        empty = torch.empty(0, dtype=torch.float32, device=query.device)
        return out.to(query.dtype), empty, empty

    # ----------------------------------------------------------------------- lightning indexer

    def npu_lightning_indexer(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        *,
        actual_seq_lengths_query: torch.Tensor | None = None,
        actual_seq_lengths_key: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        layout_query: str = "BSND",
        layout_key: str = "BSND",
        sparse_count: int = 2048,
        sparse_mode: int = 3,
        pre_tokens: int = MAX_INT64,
        next_tokens: int = MAX_INT64,
        return_value: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sparse_indices int32 [T, 1, sparse_count], sparse_values)``; values are
        empty unless ``return_value``."""
        self._record_sparse(
            "npu_lightning_indexer",
            query,
            layout_query=layout_query,
            layout_key=layout_key,
            sparse_mode=sparse_mode,
            sparse_count=sparse_count,
            actual_seq_lengths_query=actual_seq_lengths_query,
            actual_seq_lengths_key=actual_seq_lengths_key,
        )
        # Deliberate refusals as above: arguments the backend never passes are not guessed at.
        if (layout_query, layout_key) != ("TND", "PA_BSND"):
            raise NotImplementedError(f"stand-in: layouts {layout_query}/{layout_key} (served: TND / PA_BSND)")
        if (pre_tokens, next_tokens) != (MAX_INT64, MAX_INT64) or return_value:
            raise NotImplementedError("stand-in: pre_tokens/next_tokens and return_value are not served")
        if sparse_mode not in (0, 3):
            raise ValueError(f"sparse_mode must be 0 or 3, got {sparse_mode}")
        if not 1 <= sparse_count <= MAX_SPARSE_COUNT:
            raise ValueError(f"sparse_count must be 1..{MAX_SPARSE_COUNT}, got {sparse_count}")
        _check_half("query", query, key, weights)  # "query, key and weights must have one dtype"
        tokens, heads, dim = _dims("query", query, 3)
        if (heads, dim) != (INDEXER_HEADS, INDEXER_DIM):
            raise ValueError(f"query must be [T, {INDEXER_HEADS}, {INDEXER_DIM}], got {tuple(query.shape)}")
        if tuple(weights.shape) != (tokens, heads):
            raise ValueError(f"weights must be [T, N1] = {(tokens, heads)}, got {tuple(weights.shape)}")
        _, block_size = _paged_key("key", key, INDEXER_DIM)
        q_starts, q_lens = _tnd_batches(actual_seq_lengths_query, tokens)
        key_lens = _lengths("actual_seq_lengths_key", actual_seq_lengths_key, len(q_lens))
        _check_block_table(block_table, key_lens, block_size)

        out = torch.full((tokens, 1, sparse_count), -1, dtype=torch.int32, device=query.device)
        key_rows = key.reshape(-1, INDEXER_DIM)
        for b, (start, q_len, key_len) in enumerate(zip(q_starts, q_lens, key_lens, strict=True)):
            if q_len == 0:
                continue
            positions = torch.arange(key_len, device=query.device)
            slots = block_table[b, positions // block_size].long() * block_size + positions % block_size
            keys = key_rows[slots].float()
            q, w = query[start : start + q_len].float(), weights[start : start + q_len].float()
            scores = torch.einsum("nh,nhs->ns", w, torch.relu(torch.einsum("nhd,sd->nhs", q, keys)))
            for i in range(q_len):
                visible = key_len - q_len + i + 1 if sparse_mode == 3 else key_len
                if visible < min(sparse_count, key_len):
                    raise NotImplementedError(
                        f"stand-in: query row {start + i} sees {visible} keys, fewer than "
                        f"min(sparse_count, key length) = {min(sparse_count, key_len)}: what the operator "
                        "returns in the columns left is not documented"
                    )
                picked = scores[i, :visible].topk(min(sparse_count, visible)).indices
                out[start + i, 0, : picked.numel()] = picked.to(torch.int32)
        return out, torch.empty(0, dtype=query.dtype, device=query.device)


def _host(values: torch.Tensor | None) -> list[int] | None:
    return None if values is None else [int(v) for v in values.tolist()]


def _check_half(first: str, *tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    if dtype not in HALF_DTYPES:
        raise TypeError(f"{first} must be float16 or bfloat16, got {dtype}")
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"every input must be {dtype} like {first}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError("the operator does not take non-contiguous tensors")


def _dims(name: str, t: torch.Tensor, rank: int) -> tuple[int, ...]:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-d, got {tuple(t.shape)}")
    return tuple(t.shape)


def _paged_key(name: str, key: torch.Tensor, dim: int) -> tuple[int, int]:
    """PA_BSND ``[block_num, block_size, 1, dim]``; block_size a multiple of 16 up to 1024."""
    if key.dim() != 4 or key.shape[2] != 1 or key.shape[3] != dim:
        raise ValueError(f"PA_BSND {name} must be [block_num, block_size, 1, {dim}], got {tuple(key.shape)}")
    block_size = key.shape[1]
    if block_size % 16 or not 16 <= block_size <= 1024:
        raise ValueError(f"block_size must be a multiple of 16 up to 1024, got {block_size}")
    return key.shape[0], block_size


def _tnd_batches(cumulative: torch.Tensor | None, tokens: int) -> tuple[list[int], list[int]]:
    """TND query lengths are prefix sums (required): each batch's first row and length."""
    if cumulative is None or cumulative.dtype != torch.int32 or cumulative.dim() != 1:
        raise ValueError("TND queries need actual_seq_lengths_query as an int32 1-d tensor of prefix sums")
    ends = _host(cumulative)
    starts = [0, *ends[:-1]]
    if not ends or any(b < a for a, b in zip(starts, ends, strict=True)) or ends[-1] != tokens:
        raise ValueError(
            f"actual_seq_lengths_query must be non-decreasing prefix sums ending at T={tokens}, got {ends}"
        )
    return starts, [b - a for a, b in zip(starts, ends, strict=True)]


def _lengths(name: str, values: torch.Tensor | None, batch: int) -> list[int]:
    if values is None or values.dtype != torch.int32 or tuple(values.shape) != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of B={batch} lengths with a paged cache")
    lengths = _host(values)
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} has negative lengths: {lengths}")
    return lengths


def _check_block_table(table: torch.Tensor | None, lengths: list[int], block_size: int) -> None:
    if table is None or table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != len(lengths):
        raise ValueError(f"block_table must be int32 [B={len(lengths)}, max_blocks] with PA_BSND")
    needed = max((math.ceil(n / block_size) for n in lengths), default=0)
    if table.shape[1] < needed:
        raise ValueError(f"block_table has {table.shape[1]} columns, the longest sequence needs {needed}")


def _listed(row: torch.Tensor, where: int, kv_len: int) -> torch.Tensor:
    """A row's valid indices: those before its first -1, which must be all of them."""
    values = row.long()
    padding = (values == -1).nonzero()
    count = int(padding[0]) if len(padding) else values.numel()
    listed = values[:count]
    if bool((values[count:] != -1).any()):
        raise ValueError(f"sparse_indices row {where}: valid values must come first and -1 after, got {row.tolist()}")
    if count == 0:  # undocumented for the operator: the mapping must never send it (a test checks)
        raise NotImplementedError(f"stand-in: sparse_indices row {where} has no valid index (output not documented)")
    if bool(((listed < 0) | (listed >= kv_len)).any()):
        raise NotImplementedError(
            f"stand-in: sparse_indices row {where} lists {listed.tolist()} beyond kv length {kv_len} (not documented)"
        )
    return listed
