"""Paged attention by gathering each sequence's keys and values, then calling SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powertrain.interfaces import (
    AttentionBackendContext,
    AttentionLayerSpec,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)


class SdpaAttention:
    """GQA/MHA attention; the cache is ``[blocks, block_size, kv_heads, head_size]``."""

    name = "sdpa"

    def __init__(self, context: AttentionBackendContext) -> None:
        self.device = context.device

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if layer.kind != "gqa":
            raise ValueError(f"sdpa serves GQA/MHA layers only, not {layer.kind}")
        # [blocks, block_size, kv_heads, head_size] for key and value.
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
        key_cache, value_cache = kv_cache["key"], kv_cache["value"]
        metadata.store(key_cache, key)
        metadata.store(value_cache, value)
        block_size = key_cache.shape[1]
        flat_keys = key_cache.view(-1, *key_cache.shape[2:])
        flat_values = value_cache.view(-1, *value_cache.shape[2:])

        output = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        for i, seq_len in enumerate(metadata.seq_lens_host):
            q_start, q_end = starts[i], starts[i + 1]
            query_len = q_end - q_start
            # Slots of this sequence's tokens, in order, through its block table.
            positions = torch.arange(seq_len, device=query.device)
            blocks = metadata.block_tables[i, positions // block_size].long()
            slots = blocks * block_size + positions % block_size
            k = flat_keys[slots].transpose(0, 1)  # [kv_heads, seq_len, dim]
            v = flat_values[slots].transpose(0, 1)
            q = query[q_start:q_end].transpose(0, 1)  # [heads, query_len, dim]
            # Query j sits at position seq_len - query_len + j and sees keys up to it.
            query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = positions[None, :] <= query_pos[:, None]
            if layer.sliding_window is not None:
                mask &= positions[None, :] > query_pos[:, None] - layer.sliding_window
            out = F.scaled_dot_product_attention(
                q.float(),
                k.float(),
                v.float(),
                attn_mask=mask,
                scale=layer.scale,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            output[q_start:q_end] = out.transpose(0, 1).to(query.dtype)
        return output
