"""``torch-bucketed``: the default portable attention backend, plain torch, batched.

The reference backend walks sequences one by one, which costs a few dozen small
ops per sequence per layer; a decode batch of 64 spends more time in that loop than
in the model's matmuls. Here decodes are batched: each decode row is padded to a
length bucket that depends on its own length only (the next multiple of
``BUCKET``), rows of one bucket attend in one batched ``scaled_dot_product_attention``
call (GQA heads share their kv head without copies), and masked positions
contribute exact zeros. A row therefore sees the same shapes and the same arithmetic
whatever else is in the batch, which keeps results batch-invariant. Prefill rows,
which carry many tokens each, go through ``scaled_dot_product_attention`` per
sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, KVCacheSpec, LayerKVCache

#: Decode rows are padded to a multiple of this many keys (a multiple of common block sizes).
BUCKET = 64


class BucketedAttention:
    name = "torch-bucketed"

    def __init__(self) -> None:
        # Reused gather buffers: a fresh multi-megabyte tensor per layer costs page faults
        # that take longer than the copy itself. One step thread uses a backend at a time.
        self._scratch: dict[str, torch.Tensor] = {}

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if layer.kind != "gqa":
            raise ValueError(f"torch-bucketed serves GQA/MHA layers, not {layer.kind!r}")
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
        keys = key_cache.flatten(0, 1)  # [slots, kv_heads, dim]: a slot is a row
        values = value_cache.flatten(0, 1)

        output = torch.zeros_like(query)
        decodes = metadata.num_decodes
        if decodes:
            output[:decodes] = self._decode(layer, query[:decodes], key_cache, value_cache, metadata)
        starts = metadata.query_start_loc_host
        for i in range(decodes, metadata.batch_size):
            start, end = starts[i], starts[i + 1]
            output[start:end] = self._prefill(layer, query[start:end], keys, values, metadata, i)
        return output

    def _decode(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [decodes, heads, dim]
        key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        block_size = metadata.block_size
        lengths = metadata.seq_lens[: len(query)].to(torch.long)
        buckets = (lengths + BUCKET - 1) // BUCKET
        output = torch.empty_like(query)
        for bucket in sorted(set(buckets.tolist())):
            rows = (buckets == bucket).nonzero().flatten()
            num_blocks = -(-bucket * BUCKET // block_size)
            table = metadata.block_tables[rows].to(torch.long)
            if table.shape[1] < num_blocks:  # the bucket reaches past the table: those keys are masked
                table = F.pad(table, (0, num_blocks - table.shape[1]))
            table = table[:, :num_blocks]
            width = num_blocks * block_size
            # Whole blocks are gathered (a few large copies, not one per token) and read in
            # place as [rows, kv_heads, width, dim] strided views.
            keys = self._gather_blocks("key", key_cache, table).float()
            values = self._gather_blocks("value", value_cache, table).float()
            positions = torch.arange(width, device=query.device)
            visible = positions[None, :] < lengths[rows, None]
            if layer.sliding_window is not None:
                visible &= positions[None, :] >= lengths[rows, None] - layer.sliding_window
            # Slots past a sequence's end hold stale or never-written memory: keep it out of
            # the sums entirely (a masked NaN score, or 0 * NaN, would still be NaN). Only the
            # last bucket's worth of columns can lie past any of these rows' ends.
            tail = (bucket - 1) * BUCKET
            hidden = ~visible[:, tail:, None, None]
            keys[:, tail:].masked_fill_(hidden, 0.0)
            values[:, tail:].masked_fill_(hidden, 0.0)
            out = F.scaled_dot_product_attention(
                query[rows].float().unsqueeze(2),  # [r, heads, 1, dim]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=visible[:, None, None, :],
                scale=layer.scale,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            ).squeeze(2)
            output[rows] = out.to(query.dtype)
        return output

    def _gather_blocks(self, name: str, cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``cache[table]`` as ``[rows, blocks * block_size, kv_heads, dim]``. index_select over
        flattened blocks copies whole blocks at memory speed (several times faster than
        advanced indexing here), into a buffer kept between calls."""
        rows, count = table.shape
        flat = cache.flatten(1)
        needed = rows * count * flat.shape[1]
        scratch = self._scratch.get(name)
        if (
            scratch is None
            or scratch.numel() < needed
            or scratch.dtype != cache.dtype
            or scratch.device != cache.device
        ):
            scratch = self._scratch[name] = torch.empty(needed, dtype=cache.dtype, device=cache.device)
        picked = scratch[:needed].view(rows * count, flat.shape[1])
        torch.index_select(flat, 0, table.flatten(), out=picked)
        return picked.view(rows, count * cache.shape[1], *cache.shape[2:])

    def _prefill(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [q_len, heads, dim]
        keys: torch.Tensor,
        values: torch.Tensor,
        metadata: AttentionMetadata,
        index: int,
    ) -> torch.Tensor:
        block_size = metadata.block_size
        seq_len = metadata.seq_lens_host[index]
        q_len = query.shape[0]
        positions = torch.arange(seq_len, device=query.device)
        blocks = metadata.block_tables[index, : -(-seq_len // block_size)].to(torch.long)
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=query.device)).flatten()[:seq_len]
        k = keys[slots].float().transpose(0, 1)  # [kv, seq, d]
        v = values[slots].float().transpose(0, 1)
        q = query.float().transpose(0, 1)  # [heads, q_len, d]
        query_pos = positions[seq_len - q_len :, None]
        mask = positions[None, :] <= query_pos
        if layer.sliding_window is not None:
            mask &= positions[None, :] > query_pos - layer.sliding_window
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads
        )
        return out.transpose(0, 1).to(query.dtype)
