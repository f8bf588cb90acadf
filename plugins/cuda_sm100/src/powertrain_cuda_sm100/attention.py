"""``triton-sm100``: paged GQA/MHA and absorbed-MLA attention in Triton.

The host side of the kernels: it checks the layer and the cache against what the
kernels read, writes this step's keys/values into the cache, and sends the batch's
decode rows (the first ``num_decodes``, one token each) to the split-KV decode
kernel and the rest to the flash prefill kernel. Each public entry point checks its
inputs once, up front; the helpers and kernel wrappers behind it trust them (the
checks cost host time on every layer of every step). Only the factory imports this
module, so importing the plugin never imports triton.
"""

from __future__ import annotations

import torch

from powertrain.interfaces import (
    AttentionBackendContext,
    AttentionLayerSpec,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)
from powertrain.interfaces.attention import score_rows
from powertrain_cuda_sm100.kernels.cache_write import rotary_cache_write
from powertrain_cuda_sm100.kernels.indexer import index_scores
from powertrain_cuda_sm100.kernels.mla import mla_attention
from powertrain_cuda_sm100.kernels.paged_decode import paged_decode
from powertrain_cuda_sm100.kernels.prefill import prefill
from powertrain_cuda_sm100.kernels.rmsnorm import rms_norm
from powertrain_cuda_sm100.kernels.row_topk import MAX_WIDTH, row_topk
from powertrain_cuda_sm100.kernels.sparse_mla import sparse_mla_attention
from powertrain_cuda_sm100.kernels.v4_attention import v4_attention

#: What the kernels load and multiply (tl.dot has no float64 on these targets).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TritonAttention:
    """Satisfies ``AttentionBackend``, ``MLAAttentionBackend``, ``SparseMLAAttentionBackend``,
    ``V4AttentionBackend``, ``LightningIndexerBackend``, ``RotaryAttentionBackend`` and
    ``RMSNormKernel`` (see powertrain.interfaces.attention):
    where it is the attention backend, the layers' rotary, cache writes and norms run as
    this pack's kernels too."""

    name = "triton-sm100"

    def __init__(self, context: AttentionBackendContext, num_splits: int | None = None) -> None:
        self.context = context
        self.device = context.device
        #: KV splits of the decode launches: None picks them per launch to fill the GPU (so
        #: they follow the batch); a fixed count (``triton-sm100-invariant``) cuts each row's
        #: keys by its own length only, so its bits do not depend on the batch.
        self.num_splits = num_splits
        # The platform's capability picks tile configs; the interpreter reports 10.0.
        self.capability = context.platform.capability or (10, 0)

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """Block-token-major ``key``/``value`` for GQA, ``latent``/``rope`` for MLA: the
        kernels read the engine's cache in place through the block table."""
        _check_dtype(layer, dtype)
        return KVCacheSpec.standard(layer, block_size, dtype)

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's key/value at ``slot_mapping``, then attend causally."""
        return self.forward_rotary(layer, query, key, value, None, None, kv_cache, metadata)

    def forward_rotary(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotate query and key and write key/value to the cache in one kernel (without
        cos/sin: only the write), then attend over the cache."""
        if layer.kind != "gqa":
            raise ValueError(f"forward() serves GQA/MHA layers; an {layer.kind!r} layer goes through forward_mla()")
        key_cache, value_cache = kv_cache["key"], kv_cache["value"]
        _check_gqa(layer, query, key_cache, value_cache, metadata)
        _check_cache_write(query if cos is not None else None, key, key_cache, value_cache, cos, sin)
        rotated = rotary_cache_write(
            query if cos is not None else None, key, value, key_cache, value_cache, metadata.slot_mapping, cos, sin
        )
        return self._attend(layer, query if rotated is None else rotated, key_cache, value_cache, metadata)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm (+ the residual add before it) as one kernel."""
        return rms_norm(x, weight, eps, residual)

    def _attend(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of ``query`` over a cache that already holds this step's keys/values
        (checked by the caller: ``_check_gqa``)."""
        query = _last_dim_contiguous(query)
        key_cache = _last_dim_contiguous(key_cache)
        value_cache = _last_dim_contiguous(value_cache)
        out = _output_like(query, metadata)
        decodes = metadata.num_decodes
        if decodes:
            paged_decode(
                query[:decodes],
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                out[:decodes],
                scale=layer.scale,
                max_seq_len=max(metadata.seq_lens_host[:decodes]),
                sliding_window=layer.sliding_window,
                capability=self.capability,
                num_splits=self.num_splits,
            )
        if metadata.batch_size > decodes:
            prefill(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                out,
                scale=layer.scale,
                first_seq=decodes,
                num_seqs=metadata.batch_size - decodes,
                max_query_len=max(metadata.query_lens_host[decodes:]),
                sliding_window=layer.sliding_window,
                capability=self.capability,
            )
        return out

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
        """Absorbed MLA: write the new latent/rope keys, then attend over the latent cache."""
        if layer.kind != "mla":
            raise ValueError(f"forward_mla() serves MLA layers, got a {layer.kind!r} layer")
        latent_cache, rope_cache = kv_cache["latent"], kv_cache["rope"]
        _check_mla(layer, q_latent, q_rope, latent_cache, rope_cache, metadata)
        metadata.store(latent_cache, latent)
        metadata.store(rope_cache, k_rope)
        q_latent = _last_dim_contiguous(q_latent)
        q_rope = _last_dim_contiguous(q_rope)
        latent_cache = _last_dim_contiguous(latent_cache)
        rope_cache = _last_dim_contiguous(rope_cache)
        out = _output_like(q_latent, metadata)
        decodes = metadata.num_decodes
        common = {
            "scale": layer.scale,
            "sliding_window": layer.sliding_window,
            "capability": self.capability,
        }
        tables = (metadata.block_tables, metadata.seq_lens, metadata.query_start_loc)
        if decodes:
            mla_attention(
                q_latent[:decodes],
                q_rope[:decodes],
                latent_cache,
                rope_cache,
                *tables,
                out[:decodes],
                first_seq=0,
                num_seqs=decodes,
                max_query_len=1,
                max_seq_len=max(metadata.seq_lens_host[:decodes]),
                decode=True,
                num_splits=self.num_splits,
                **common,
            )
        if metadata.batch_size > decodes:
            mla_attention(
                q_latent,
                q_rope,
                latent_cache,
                rope_cache,
                *tables,
                out,
                first_seq=decodes,
                num_seqs=metadata.batch_size - decodes,
                max_query_len=max(metadata.query_lens_host[decodes:]),
                max_seq_len=max(metadata.seq_lens_host[decodes:]),
                decode=False,
                **common,
            )
        return out

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
        """DeepSeek-V3.2's sparse MLA: write the new latent/rope keys, then each query token
        attends to the positions its row of ``indices`` lists (decode and prefill rows alike,
        one launch). Out-of-range indices are refused on the device (no sync, so a decode
        step can be captured): read as padding, raised by the runner once the step has run."""
        if layer.kind != "mla":
            raise ValueError(f"forward_mla_sparse() serves MLA layers, got a {layer.kind!r} layer")
        latent_cache, rope_cache = kv_cache["latent"], kv_cache["rope"]
        _check_mla(layer, q_latent, q_rope, latent_cache, rope_cache, metadata)
        if indices.device != q_latent.device:
            raise ValueError(f"triton-sm100: sparse indices on {indices.device}, the queries on {q_latent.device}")
        indices = metadata.refuse_sparse_indices(indices)
        metadata.store(latent_cache, latent)
        metadata.store(rope_cache, k_rope)
        out = _output_like(q_latent, metadata)
        tokens = metadata.num_tokens
        if tokens == 0:
            return out
        sparse_mla_attention(
            _last_dim_contiguous(q_latent)[:tokens],
            _last_dim_contiguous(q_rope)[:tokens],
            _last_dim_contiguous(latent_cache),
            _last_dim_contiguous(rope_cache),
            metadata.block_tables,
            metadata.token_sequences,  # each query row's sequence, built once per step
            _last_dim_contiguous(indices)[:tokens],
            out[:tokens],
            scale=layer.scale,
        )
        return out

    def forward_v4(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        sinks: torch.Tensor,
        *,
        window: int,
        compress_rate: int | None = None,
        entry_indices: torch.Tensor | None = None,
        derotate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """DeepSeek-V4 attention: each token over its window of raw keys and its compressed
        entries (all closed ones, or the listed ones), with the heads' sinks; one launch
        for decode and prefill rows, the de-rotation fused into its store. Listed entries
        are range-checked on the device, as ``forward_mla_sparse``'s indices are."""
        _check_dtype(layer, query.dtype)
        kv = kv_cache["kv"]
        entries = None if compress_rate is None else kv_cache["compressed"]
        if window < 1:
            raise ValueError(f"triton-sm100: V4 window={window}; a window holds at least the token itself (>= 1)")
        if entry_indices is not None:
            if entries is None:
                raise ValueError("triton-sm100: entry_indices name compressed entries, but compress_rate is None")
            entry_indices = metadata.refuse_sparse_indices(entry_indices, compress_rate)
        windowed, full = metadata.for_window(window), metadata.for_window(None)
        _check_metadata(kv, windowed)
        if entries is not None and entries.shape[1] * compress_rate != metadata.block_size:
            raise ValueError(
                f"triton-sm100: compressed cache blocks hold {entries.shape[1]} entries, but blocks of "
                f"{metadata.block_size} tokens hold {metadata.block_size // compress_rate} at rate {compress_rate}"
            )
        out = _output_like(query, metadata)
        tokens = metadata.num_tokens
        if tokens == 0:
            return out
        v4_attention(
            _last_dim_contiguous(query)[:tokens],
            _last_dim_contiguous(kv),
            None if entries is None else _last_dim_contiguous(entries),
            windowed.block_tables,
            full.block_tables,
            metadata.token_sequences,
            metadata.query_start_loc,
            metadata.seq_lens,
            None if entry_indices is None else _last_dim_contiguous(entry_indices)[:tokens],
            sinks.float().contiguous(),
            out[:tokens],
            scale=layer.scale,
            window=window,
            rate=compress_rate,
            max_seq_len=metadata.max_seq_len,
            derotate=None if derotate is None else _rotary_rows(derotate, tokens, layer.head_size),
        )
        return out

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
        """The Lightning Indexer: every token's scores over its sequence's cached keys in one
        launch (``-inf`` where it cannot see), then each row's best in another (``row_topk``:
        radix select, then a sort of the picks; ``torch.topk`` past ``MAX_WIDTH``)."""
        if query.dtype not in SUPPORTED_DTYPES or keys.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"triton-sm100: indexer queries in {query.dtype}, keys in {keys.dtype}; the kernel takes "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
        if keys.shape[1] * tokens_per_entry != metadata.block_size:
            raise ValueError(
                f"triton-sm100: indexer key blocks hold {keys.shape[1]} keys, but blocks of {metadata.block_size} "
                f"tokens hold {metadata.block_size // tokens_per_entry} at one key per {tokens_per_entry} tokens"
            )
        tokens = metadata.num_tokens
        columns = metadata.max_seq_len // tokens_per_entry
        width = max(1, min(topk, columns))
        picked = torch.full((query.shape[0], width), -1, dtype=torch.int32, device=query.device)
        if tokens == 0 or columns == 0:
            return picked
        query, keys = _last_dim_contiguous(query), _last_dim_contiguous(keys)
        weights = _last_dim_contiguous(weights.float())
        step = score_rows(columns)  # a long prefill at long context is scored a slice of rows at a time
        for first in range(0, tokens, step):
            last = min(first + step, tokens)
            scores = index_scores(
                query[first:last],
                weights[first:last],
                keys,
                metadata.block_tables,
                metadata.token_sequences[first:last],
                metadata.query_start_loc,
                metadata.seq_lens,
                columns=columns,
                tokens_per_entry=tokens_per_entry,
                first_token=first,
            )
            if width <= MAX_WIDTH:
                picked[first:last] = row_topk(scores, width)
            else:
                best, chosen = scores.topk(width, dim=-1)
                picked[first:last] = chosen.masked_fill(best == float("-inf"), -1).to(torch.int32)
        return picked


# --------------------------------------------------------------------------- checks


def _check_dtype(layer: AttentionLayerSpec, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"triton-sm100: a {layer.kind} layer in {dtype} is not supported; "
            f"the kernels take {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )


def _check_window(layer: AttentionLayerSpec) -> None:
    if layer.sliding_window is not None and layer.sliding_window < 1:
        raise ValueError(
            f"triton-sm100: sliding_window={layer.sliding_window}; a window holds at least the token itself (>= 1), "
            "or is None for full attention"
        )


def _check_metadata(cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    if cache.shape[1] != metadata.block_size:
        raise ValueError(
            f"triton-sm100: cache blocks hold {cache.shape[1]} tokens but the metadata says "
            f"block_size={metadata.block_size}; allocate the cache from kv_cache_spec with the engine's block size"
        )


def _check_gqa(
    layer: AttentionLayerSpec,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    _check_dtype(layer, query.dtype)
    _check_window(layer)
    if layer.num_heads % layer.num_kv_heads:
        raise ValueError(f"num_heads={layer.num_heads} is not a multiple of num_kv_heads={layer.num_kv_heads}")
    expected = (layer.num_kv_heads, layer.head_size)
    for name, cache in (("key", key_cache), ("value", value_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != expected:
            raise ValueError(
                f"triton-sm100: {name} cache of shape {tuple(cache.shape)}; the kernels read the block-token-major "
                f"layout [num_blocks, block_size, {expected[0]}, {expected[1]}] that kv_cache_spec declares"
            )
        _check_metadata(cache, metadata)
    if tuple(query.shape[1:]) != (layer.num_heads, layer.head_size):
        raise ValueError(
            f"triton-sm100: query of shape {tuple(query.shape)}, the layer has "
            f"{layer.num_heads} heads of {layer.head_size}"
        )


def _check_cache_write(
    query: torch.Tensor | None,
    key: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
) -> None:
    """What ``rotary_cache_write`` reads beyond ``_check_gqa``: the new keys against the
    cache, and (when rotating: ``query`` given) the query and the cos/sin tables."""
    tokens, kv_heads, head_size = key.shape
    if query is not None and (query.shape[0] != tokens or query.shape[2] != head_size):
        raise ValueError(
            f"triton-sm100: query of {tuple(query.shape)} and key of {tuple(key.shape)} do not pair up; "
            "pass one query and one key row per token, of the same head size"
        )
    if key_cache.shape[-2:] != (kv_heads, head_size) or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"triton-sm100: cache of {tuple(key_cache.shape)} cannot hold keys of {kv_heads} heads x {head_size}; "
            "key is [tokens, num_kv_heads, head_size] of the layer, and the value cache is shaped like the key cache"
        )
    half = 0 if cos is None else cos.shape[-1]
    if half and (2 * half > head_size or cos.shape != sin.shape or cos.shape[0] < tokens):
        raise ValueError(
            f"triton-sm100: cos/sin of {tuple(cos.shape)} do not fit {tokens} tokens of head_size {head_size}; "
            "pass cos and sin alike, [>= tokens, rotary_dim // 2] with rotary_dim <= head_size"
        )


def _check_mla(
    layer: AttentionLayerSpec,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    _check_dtype(layer, q_latent.dtype)
    _check_window(layer)
    rank, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
    for name, cache, width in (("latent", latent_cache, rank), ("rope", rope_cache, rope)):
        if cache.dim() != 3 or cache.shape[2] != width:
            raise ValueError(
                f"triton-sm100: MLA {name} cache of shape {tuple(cache.shape)}; the kernel reads "
                f"[num_blocks, block_size, {width}] as kv_cache_spec declares"
            )
        _check_metadata(cache, metadata)
    if tuple(q_latent.shape[1:]) != (layer.num_heads, rank) or tuple(q_rope.shape[1:]) != (layer.num_heads, rope):
        raise ValueError(
            f"triton-sm100: q_latent {tuple(q_latent.shape)} / q_rope {tuple(q_rope.shape)} do not match the layer's "
            f"{layer.num_heads} heads of kv_lora_rank={rank} and qk_rope_head_dim={rope}"
        )


# --------------------------------------------------------------------------- tensors


def _rotary_rows(
    derotate: tuple[torch.Tensor, torch.Tensor], tokens: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``derotate``'s cos and sin, their first ``tokens`` rows contiguous, or a ValueError
    saying what does not fit (``[num_tokens, pairs]`` each, ``2 * pairs <= head_size``)."""
    cos, sin = derotate
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] < tokens or 2 * cos.shape[1] > head_size:
        raise ValueError(
            f"triton-sm100: derotate takes cos and sin of shape [num_tokens={tokens}, pairs] with "
            f"2 * pairs <= head_size {head_size}; got {list(cos.shape)} and {list(sin.shape)}"
        )
    return cos[:tokens].contiguous(), sin[:tokens].contiguous()


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """Kernels take any strides but the innermost (a strided view of a fused projection is
    fine as it is); only a view strided along its last dim is copied."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _output_like(query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The output, in the query's dtype; rows past ``num_tokens`` (graph padding) are zeros."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape[0] > metadata.num_tokens:
        out[metadata.num_tokens :].zero_()
    return out
