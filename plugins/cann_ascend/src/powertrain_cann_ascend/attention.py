"""``ascend-cann`` attention: ``npu_fused_infer_attention_score`` over the paged cache.

Written against torch_npu's documented API as of Ascend Extension for PyTorch 7.0.0
(torch_npu 2.5.1.post1 / 2.6.0 with CANN 8.1.RC1; the signature with ``scale``,
``query_rope`` and ``key_rope``), see ``docs/context/torch_npu-npu_fused_infer_attention_score.md``
in Ascend/op-plugin and hiascend.com's "torch_npu.npu_fused_infer_attention_score" page.

How the engine's batch maps onto the op (the pure functions below do the mapping, so
tests check the exact arguments):

* Cache: ``key``/``value`` are ``[num_blocks, block_size, kv_heads * head_size]``, the
  op's paged (blocknum, blocksize, H) layout, declared through ``KVCacheSpec`` so the
  engine allocates it that way and nothing is re-laid out per step. New tokens are
  written with ``npu_scatter_nd_update_`` at ``slot_mapping`` (a cache of slots x H).
* GQA/MHA decode rows (one query token each) go in one call with ``input_layout="BSH"``
  and query ``[decodes, 1, heads * head_size]``: Q_S = 1 takes the op's incremental
  (IncreFlashAttention) branch, which needs no mask and ignores ``sparse_mode``.
* GQA/MHA prefill rows (new prompts, chunks after cached tokens, speculative
  verification) go in a second call, BSH with the queries padded to
  ``[prefills, max_query_len, H]`` and their real lengths in ``actual_seq_lengths``:
  Q_S > 1 takes the prompt (PromptFlashAttention) branch, and ``sparse_mode=3``
  (rightDownCausal) with the fixed 2048 x 2048 lower-triangular mask aligns the causal
  diagonal to the end of each sequence's keys, which is exactly "new tokens after
  ``seq_len - query_len`` cached ones". Two calls rather than one keep decode rows out
  of the padded prefill query (each would be padded to the longest prompt) and on the
  decode kernel. The documented TND layout would avoid the padding, but the doc this
  targets does not allow paged attention with TND for head dims other than 512.
* MLA (``forward_mla``): query = ``q_latent``, ``query_rope`` = ``q_rope``, key = value =
  the latent cache, ``key_rope`` = the rope cache, layout TND (cumulative query
  lengths, per-sequence kv lengths). The op's rope path takes 1..16 query tokens per
  sequence, so longer prefills are cut into pieces of at most 16 tokens, each its own
  "sequence" over the same blocks whose kv length ends at the piece (with rightDownCausal
  that is the causal rule again). It takes 32, 64 or 128 query heads, so fewer heads
  (e.g. DeepSeek-V3's 128 over 8 ranks) are padded with zero queries whose outputs are
  dropped.

Constraints the doc states and this backend therefore requires: float16/bfloat16;
paged prefill needs ``block_size`` a multiple of 128 up to 512, MLA needs 16 or 128
(so 128 serves both); MLA needs ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from powertrain.interfaces import (
    AttentionBackendContext,
    AttentionLayerSpec,
    AttentionMetadata,
    KVCacheSpec,
    KVTensorSpec,
    LayerKVCache,
)
from powertrain_cann_ascend.sparse import (
    TokenBatches,
    check_indexer_widths,
    compact_indices,
    indexer_args,
    sparse_attention_args,
    sparse_padded_heads,
    visible_keys,
    visible_picks,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: sparse_mode 2/3/4 take an "optimised" causal mask of exactly this size.
CAUSAL_MASK_SIZE = 2048
#: Block sizes the prompt branch accepts with a paged cache (Q_S > 1).
PROMPT_BLOCK_SIZES = (128, 256, 384, 512)
#: The rope (MLA) path: block sizes, widths, query heads, query tokens per sequence.
MLA_BLOCK_SIZES = (16, 128)
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_HEAD_COUNTS = (32, 64, 128)
MLA_MAX_QUERY_LEN = 16
#: num_heads / num_key_value_heads may not exceed this.
MAX_GQA_GROUP = 64


def causal_mask(device: torch.device | str) -> torch.Tensor:
    """The mask ``sparse_mode=3`` wants: 2048 x 2048, True (= not computed) above the diagonal."""
    ones = torch.ones((CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE), dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def check_block_size(layer: AttentionLayerSpec, block_size: int) -> None:
    allowed = MLA_BLOCK_SIZES if layer.kind == "mla" else PROMPT_BLOCK_SIZES
    if block_size not in allowed:
        raise ValueError(
            f"ascend-cann: npu_fused_infer_attention_score's paged {layer.kind.upper()} path takes block sizes "
            f"{list(allowed)}, got block_size={block_size}; set [cache] block_size = 128 (it serves GQA and MLA)"
        )


# --------------------------------------------------------------------------- GQA / MHA mapping


def decode_args(layer: AttentionLayerSpec, metadata: AttentionMetadata) -> dict[str, Any]:
    """Keyword arguments of the decode call (the first ``num_decodes`` sequences, BSH, Q_S = 1)."""
    n = metadata.num_decodes
    return {
        "num_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "scale": layer.scale,
        "input_layout": "BSH",
        "block_table": metadata.block_tables[:n],
        "block_size": metadata.block_size,
        "actual_seq_lengths_kv": list(metadata.seq_lens_host[:n]),
        "sparse_mode": 0,
    }


def prefill_args(layer: AttentionLayerSpec, metadata: AttentionMetadata, mask: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of the prefill call (sequences after the decodes, padded BSH, causal)."""
    first = metadata.num_decodes
    return {
        "num_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "scale": layer.scale,
        "input_layout": "BSH",
        "block_table": metadata.block_tables[first:],
        "block_size": metadata.block_size,
        "actual_seq_lengths": list(metadata.query_lens_host[first:]),
        "actual_seq_lengths_kv": list(metadata.seq_lens_host[first:]),
        "sparse_mode": 3,
        "atten_mask": mask,
    }


@attrs.frozen
class PaddedRows:
    """Where the prefill tokens sit in the BSH query ``[batch, max_len, H]``.

    ``rows[i]`` is the row, in that query flattened to ``[batch * max_len, H]``, of
    the ``i``-th prefill token of the flat batch (counted from the first prefill token).
    """

    batch: int
    max_len: int
    rows: tuple[int, ...]


def prefill_rows(metadata: AttentionMetadata) -> PaddedRows:
    lengths = metadata.query_lens_host[metadata.num_decodes :]
    max_len = max(lengths, default=0)
    rows = tuple(b * max_len + s for b, length in enumerate(lengths) for s in range(length))
    return PaddedRows(batch=len(lengths), max_len=max_len, rows=rows)


# --------------------------------------------------------------------------- MLA mapping


@attrs.frozen
class MLAPieces:
    """Query pieces of at most 16 tokens, each attended as its own TND sequence.

    Piece ``i`` belongs to metadata sequence ``sequences[i]``, has ``query_lens[i]``
    tokens (consecutive in the flat batch, pieces in flat order) and sees the first
    ``kv_lens[i]`` keys of its sequence.
    """

    sequences: tuple[int, ...]
    query_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def mla_pieces(metadata: AttentionMetadata, first: int, stop: int, max_len: int = MLA_MAX_QUERY_LEN) -> MLAPieces:
    """Sequences ``first..stop-1`` cut into pieces of at most ``max_len`` query tokens."""
    sequences, query_lens, kv_lens = [], [], []
    for i in range(first, stop):
        q, seq_len = metadata.query_lens_host[i], metadata.seq_lens_host[i]
        context = seq_len - q
        for start in range(0, q, max_len):
            end = min(start + max_len, q)
            sequences.append(i)
            query_lens.append(end - start)
            kv_lens.append(context + end)
    return MLAPieces(sequences=tuple(sequences), query_lens=tuple(query_lens), kv_lens=tuple(kv_lens))


def mla_padded_heads(num_heads: int) -> int:
    """The head count the rope path is called with: the smallest of 32/64/128 that holds ``num_heads``."""
    for count in MLA_HEAD_COUNTS:
        if num_heads <= count:
            return count
    raise ValueError(
        f"ascend-cann: npu_fused_infer_attention_score's MLA path takes at most {MLA_HEAD_COUNTS[-1]} query "
        f"heads, the layer has {num_heads} (shard heads over more ranks)"
    )


def mla_args(
    layer: AttentionLayerSpec,
    pieces: MLAPieces,
    block_table: torch.Tensor,
    block_size: int,
    mask: torch.Tensor | None,
) -> dict[str, Any]:
    """Keyword arguments of one MLA call (TND): ``mask`` None for decode pieces (Q_S = 1,
    sparse_mode 0 without mask, as the rope path requires), the causal mask otherwise."""
    return {
        "num_heads": mla_padded_heads(layer.num_heads),
        "num_key_value_heads": 1,
        "scale": layer.scale,
        "input_layout": "TND",
        "block_table": block_table,
        "block_size": block_size,
        "actual_seq_lengths": list(itertools.accumulate(pieces.query_lens)),
        "actual_seq_lengths_kv": list(pieces.kv_lens),
        "sparse_mode": 0 if mask is None else 3,
        "atten_mask": mask,
    }


# --------------------------------------------------------------------------- the backend


class AscendAttention:
    """Satisfies ``AttentionBackend`` and ``MLAAttentionBackend`` with torch_npu's fused op,
    ``SparseMLAAttentionBackend`` and ``LightningIndexerBackend`` with its DeepSeek-V3.2 ops.

    ``ops`` is the ``torch_npu`` module (or, in tests, stand-ins with the same calls).
    """

    name = "ascend-cann"

    def __init__(self, context: AttentionBackendContext, ops: Any) -> None:
        if context.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"ascend-cann: npu_fused_infer_attention_score computes in float16 or bfloat16, "
                f"the engine asked for {context.dtype}; set [model] dtype to float16 or bfloat16"
            )
        self.ops = ops
        self.device = context.device
        self._mask: torch.Tensor | None = None
        # Per-step values shared by every layer (host-built index tensors, block tables).
        self._step: tuple[AttentionMetadata | None, dict[str, Any]] = (None, {})

    # ----------------------------------------------------------------------- cache

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The op's (blocknum, blocksize, H) cache: ``key``/``value`` of kv_heads * head_size
        per token for GQA; ``latent`` (512) and ``rope`` (64) for MLA."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"ascend-cann: the cache must be float16 or bfloat16, got {dtype}")
        check_block_size(layer, block_size)
        if layer.kind == "mla":
            _check_mla_widths(layer)
            tensors = (
                KVTensorSpec(name="latent", shape=(layer.kv_lora_rank,)),
                KVTensorSpec(name="rope", shape=(layer.qk_rope_head_dim,)),
            )
        else:
            hidden = layer.num_kv_heads * layer.head_size
            tensors = (KVTensorSpec(name="key", shape=(hidden,)), KVTensorSpec(name="value", shape=(hidden,)))
        return KVCacheSpec(block_size=block_size, dtype=dtype, tensors=tensors, layout="block-token-major")

    def _store(self, cache: torch.Tensor, new: torch.Tensor, metadata: AttentionMetadata) -> None:
        """New tokens' rows into the cache at their slots (padding rows past num_tokens are skipped)."""
        if cache.dim() != 3 or cache.shape[1] != metadata.block_size:
            raise ValueError(
                f"ascend-cann: cache tensor of shape {tuple(cache.shape)} is not [num_blocks, "
                f"{metadata.block_size}, H]; allocate it from kv_cache_spec with the engine's block size"
            )
        tokens = metadata.num_tokens
        slots = metadata.slot_mapping[:tokens].view(tokens, 1)
        rows = new[:tokens].reshape(tokens, cache.shape[2]).to(cache.dtype)
        self.ops.npu_scatter_nd_update_(cache.view(-1, cache.shape[2]), slots, rows)

    # ----------------------------------------------------------------------- per step

    def _causal_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = causal_mask(self.device)
        return self._mask

    def _cached(self, metadata: AttentionMetadata, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per step (the same metadata object serves every layer)."""
        owner, values = self._step
        if owner is not metadata:
            values = {}
            self._step = (metadata, values)
        if key not in values:
            values[key] = build()
        return values[key]

    # ----------------------------------------------------------------------- GQA / MHA

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new keys/values, then one decode call and one prefill call (either may be absent)."""
        if layer.kind != "gqa":
            raise ValueError(f"forward() serves GQA/MHA layers; an {layer.kind!r} layer goes through forward_mla()")
        if layer.sliding_window is not None:
            raise ValueError("ascend-cann does not declare 'sliding-window'; this layer needs a backend that does")
        key_cache, value_cache = kv_cache["key"], kv_cache["value"]
        self._store(key_cache, key, metadata)
        self._store(value_cache, value, metadata)

        tokens, decodes = metadata.num_tokens, metadata.num_decodes
        hidden = layer.num_heads * layer.head_size
        output = torch.empty_like(query)
        output[tokens:].zero_()  # padding rows: unspecified, but not garbage
        if decodes:
            q = query[:decodes].reshape(decodes, 1, hidden).contiguous()
            out, _ = self.ops.npu_fused_infer_attention_score(q, key_cache, value_cache, **decode_args(layer, metadata))
            output[:decodes] = out.view(decodes, layer.num_heads, layer.head_size)
        if decodes < metadata.batch_size:
            first = metadata.query_start_loc_host[decodes]
            padded = self._cached(metadata, "prefill_rows", lambda: prefill_rows(metadata))
            rows = self._cached(
                metadata, "prefill_row_index", lambda: torch.tensor(padded.rows, dtype=torch.long, device=self.device)
            )
            q = query.new_zeros((padded.batch * padded.max_len, hidden))
            q[rows] = query[first:tokens].reshape(tokens - first, hidden)
            out, _ = self.ops.npu_fused_infer_attention_score(
                q.view(padded.batch, padded.max_len, hidden),
                key_cache,
                value_cache,
                **prefill_args(layer, metadata, self._causal_mask()),
            )
            output[first:tokens] = out.reshape(-1, hidden)[rows].view(-1, layer.num_heads, layer.head_size)
        return output

    # ----------------------------------------------------------------------- MLA

    def forward_mla(
        self,
        layer: AttentionLayerSpec,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Absorbed MLA through the op's rope path: decode pieces, then prefill pieces."""
        if layer.kind != "mla":
            raise ValueError(f"forward_mla() serves MLA layers, got a {layer.kind!r} layer")
        _check_mla_widths(layer)
        latent_cache, rope_cache = kv_cache["latent"], kv_cache["rope"]
        self._store(latent_cache, latent, metadata)
        self._store(rope_cache, k_rope, metadata)

        tokens, decodes, batch = metadata.num_tokens, metadata.num_decodes, metadata.batch_size
        heads = mla_padded_heads(layer.num_heads)
        query = _pad_heads(q_latent[:tokens], heads)
        query_rope = _pad_heads(q_rope[:tokens], heads)
        output = q_latent.new_zeros(q_latent.shape)
        calls = []
        if decodes:
            pieces = self._cached(metadata, "mla_decode_pieces", lambda: mla_pieces(metadata, 0, decodes))
            calls.append((0, pieces, metadata.block_tables[:decodes], None))
        if decodes < batch:
            pieces = self._cached(metadata, "mla_prefill_pieces", lambda: mla_pieces(metadata, decodes, batch))
            table = self._cached(
                metadata,
                "mla_block_table",
                lambda: metadata.block_tables[torch.tensor(pieces.sequences, dtype=torch.long, device=self.device)],
            )
            calls.append((metadata.query_start_loc_host[decodes], pieces, table, self._causal_mask()))
        for start, pieces, table, mask in calls:
            end = start + pieces.num_tokens
            out, _ = self.ops.npu_fused_infer_attention_score(
                query[start:end],
                latent_cache,
                latent_cache,
                query_rope=query_rope[start:end],
                key_rope=rope_cache,
                **mla_args(layer, pieces, table, metadata.block_size, mask),
            )
            output[start:end] = out[:, : layer.num_heads]
        return output

    # ----------------------------------------------------------------------- DeepSeek-V3.2 (sparse.py maps them)

    def forward_mla_sparse(
        self,
        layer: AttentionLayerSpec,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        indices: torch.Tensor,
    ) -> torch.Tensor:
        """Sparse MLA through ``npu_sparse_flash_attention``, one query batch per token."""
        if layer.kind != "mla":
            raise ValueError(f"forward_mla_sparse() serves MLA layers, got a {layer.kind!r} layer")
        _check_mla_widths(layer)
        metadata.check_sparse_indices(indices)  # before the cache write: a refused step leaves it as it was
        latent_cache, rope_cache = kv_cache["latent"], kv_cache["rope"]
        self._store(latent_cache, latent, metadata)
        self._store(rope_cache, k_rope, metadata)

        tokens = metadata.num_tokens
        output = q_latent.new_zeros(q_latent.shape)
        if not tokens:
            return output
        heads = sparse_padded_heads(layer.num_heads)
        batches = self._cached(metadata, "token_batches", lambda: TokenBatches.of(metadata))
        compact, empty = compact_indices(indices[:tokens])
        blocks, block_size = latent_cache.shape[:2]
        out, _, _ = self.ops.npu_sparse_flash_attention(
            _pad_heads(q_latent[:tokens], heads),
            latent_cache.view(blocks, block_size, 1, -1),
            latent_cache.view(blocks, block_size, 1, -1),
            compact.view(tokens, 1, -1),
            query_rope=_pad_heads(q_rope[:tokens], heads),
            key_rope=rope_cache.view(blocks, block_size, 1, -1),
            **sparse_attention_args(batches, layer.scale),
        )
        output[:tokens] = out[:, : layer.num_heads].masked_fill(empty[:, None, None], 0).to(output.dtype)
        return output

    def index_topk(
        self,
        query: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        topk: int,
        tokens_per_entry: int = 1,
    ) -> torch.Tensor:
        """The Lightning Indexer through ``npu_lightning_indexer``, one query batch per token."""
        check_indexer_widths(query)
        tokens = metadata.num_tokens
        width = max(1, min(topk, metadata.max_seq_len // tokens_per_entry))
        if not tokens:
            return torch.full((0, width), -1, dtype=torch.int32, device=query.device)
        batches = self._cached(metadata, "token_batches", lambda: TokenBatches.of(metadata))
        visible = visible_keys(batches, tokens_per_entry)
        picked, _ = self.ops.npu_lightning_indexer(
            query[:tokens].contiguous(),
            keys.view(keys.shape[0], keys.shape[1], 1, keys.shape[2]),
            weights[:tokens].to(query.dtype).contiguous(),
            **indexer_args(batches, visible, width),
        )
        return visible_picks(picked, visible)


def _check_mla_widths(layer: AttentionLayerSpec) -> None:
    if (layer.kv_lora_rank, layer.qk_rope_head_dim) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
        raise ValueError(
            "ascend-cann: npu_fused_infer_attention_score's MLA path takes kv_lora_rank="
            f"{MLA_LATENT_DIM} and qk_rope_head_dim={MLA_ROPE_DIM} (DeepSeek-V2/V3 shapes), the layer has "
            f"{layer.kv_lora_rank} and {layer.qk_rope_head_dim}"
        )


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, n, d]`` -> contiguous ``[T, heads, d]``, extra heads zero (their outputs are dropped)."""
    if x.shape[1] == heads:
        return x.contiguous()
    padded = x.new_zeros((x.shape[0], heads, x.shape[2]))
    padded[:, : x.shape[1]] = x
    return padded
