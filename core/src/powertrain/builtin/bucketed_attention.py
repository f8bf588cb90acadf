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

import attrs
import torch
import torch.nn.functional as F

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, KVCacheSpec, LayerKVCache

#: Decode rows are padded to a multiple of this many keys (a multiple of common block sizes).
BUCKET = 64


@attrs.frozen
class _DecodeBucket:
    """The decode rows of one length bucket and what attending over them needs."""

    rows: torch.Tensor  # int64 [r]: indices among the decode rows
    blocks: torch.Tensor  # int64 [r * blocks_per_row]: each row's blocks, padded with block 0
    visible: torch.Tensor  # bool [r, 1, 1, width]: the keys each row attends to
    tail: int  # first column that lies past the end of some row
    stale: torch.Tensor  # bool [r, width - tail, 1, 1]: columns from ``tail`` on that are not visible

    @classmethod
    def plan(cls, metadata: AttentionMetadata, sliding_window: int | None) -> list[_DecodeBucket]:
        block_size = metadata.block_size
        lengths = metadata.seq_lens[: metadata.num_decodes].to(torch.long)
        buckets = (lengths + BUCKET - 1) // BUCKET
        plan = []
        for bucket in sorted(set(buckets.tolist())):
            rows = (buckets == bucket).nonzero().flatten()
            num_blocks = -(-bucket * BUCKET // block_size)
            table = metadata.block_tables[rows].to(torch.long)
            if table.shape[1] < num_blocks:  # the bucket reaches past the table: those keys are masked
                table = F.pad(table, (0, num_blocks - table.shape[1]))
            width = num_blocks * block_size
            positions = torch.arange(width, device=lengths.device)
            visible = positions[None, :] < lengths[rows, None]
            if sliding_window is not None:
                visible &= positions[None, :] >= lengths[rows, None] - sliding_window
            tail = (bucket - 1) * BUCKET
            plan.append(
                cls(
                    rows=rows,
                    blocks=table[:, :num_blocks].flatten(),
                    visible=visible[:, None, None, :],
                    tail=tail,
                    stale=~visible[:, tail:, None, None],
                )
            )
        return plan


class BucketedAttention:
    name = "torch-bucketed"

    def __init__(self) -> None:
        # Reused gather buffers: a fresh multi-megabyte tensor per layer costs page faults
        # that take longer than the copy itself. One step thread uses a backend at a time.
        self._scratch: dict[str, torch.Tensor] = {}
        # The decode plan of the step being run, per sliding window (see _decode_plan).
        self._plans: tuple[AttentionMetadata | None, dict[int | None, list[_DecodeBucket]]] = (None, {})

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
        decodes, heads, dim = query.shape
        kv_heads = layer.num_kv_heads
        # The query heads that share a kv head are that head's query rows (a row of
        # ``heads // kv_heads`` queries with one mask), so each kv head is read once.
        grouped = query.view(decodes, kv_heads, heads // kv_heads, dim)
        output = torch.empty_like(grouped)
        for bucket in self._decode_plan(metadata, layer.sliding_window):
            keys = self._gather_blocks("key", key_cache, bucket.blocks, len(bucket.rows))
            values = self._gather_blocks("value", value_cache, bucket.blocks, len(bucket.rows))
            # Slots past a sequence's end hold stale or never-written memory: keep it out of
            # the sums entirely (a masked NaN score, or 0 * NaN, would still be NaN). Only the
            # last bucket's worth of columns can lie past any of these rows' ends.
            keys[:, bucket.tail :].masked_fill_(bucket.stale, 0.0)
            values[:, bucket.tail :].masked_fill_(bucket.stale, 0.0)
            output[bucket.rows] = F.scaled_dot_product_attention(
                grouped[bucket.rows],
                keys.transpose(1, 2).to(query.dtype),  # [r, kv_heads, width, dim]
                values.transpose(1, 2).to(query.dtype),
                attn_mask=bucket.visible,
                scale=layer.scale,
            )
        return output.view(decodes, heads, dim)

    def _decode_plan(self, metadata: AttentionMetadata, sliding_window: int | None) -> list[_DecodeBucket]:
        """Rows, blocks and masks of each length bucket: the same for every layer of a step,
        so built once per step (and window) and reused."""
        if self._plans[0] is not metadata:
            self._plans = (metadata, {})
        plans = self._plans[1]
        if sliding_window not in plans:
            plans[sliding_window] = _DecodeBucket.plan(metadata, sliding_window)
        return plans[sliding_window]

    def _gather_blocks(self, name: str, cache: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
        """``cache[blocks]`` as ``[rows, width, kv_heads, dim]`` (``blocks`` is a flat table of
        ``rows`` rows). index_select over flattened blocks copies whole blocks at memory speed
        (several times faster than advanced indexing here), into a buffer kept between calls."""
        flat = cache.flatten(1)
        needed = blocks.numel() * flat.shape[1]
        scratch = self._scratch.get(name)
        if (
            scratch is None
            or scratch.numel() < needed
            or scratch.dtype != cache.dtype
            or scratch.device != cache.device
        ):
            scratch = self._scratch[name] = torch.empty(needed, dtype=cache.dtype, device=cache.device)
        picked = scratch[:needed].view(blocks.numel(), flat.shape[1])
        torch.index_select(flat, 0, blocks, out=picked)
        return picked.view(rows, -1, *cache.shape[2:])

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
        k = keys[slots].to(query.dtype).transpose(0, 1)  # [kv, seq, d]
        v = values[slots].to(query.dtype).transpose(0, 1)
        q = query.transpose(0, 1)  # [heads, q_len, d]
        query_pos = positions[seq_len - q_len :, None]
        mask = positions[None, :] <= query_pos
        if layer.sliding_window is not None:
            mask &= positions[None, :] > query_pos - layer.sliding_window
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads
        )
        return out.transpose(0, 1)
