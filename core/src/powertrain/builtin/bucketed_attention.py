"""``torch-bucketed``: the default portable attention backend, plain torch, batched.

The reference backend walks sequences one by one, which costs a few dozen small
ops per sequence per layer; a decode batch of 64 spends more time in that loop than
in the model's matmuls, and so does a batch of speculative verifications (a few new
tokens per sequence). Here every short row — at most ``SHORT_QUERY`` new tokens:
decodes, verifications, short chunks — is batched: its keys are padded to a length
bucket that depends on its own length only (the next multiple of ``BUCKET``), its
queries to a width that depends on its own query length only (``query_width``), rows
of one (bucket, width) attend in one batched
``scaled_dot_product_attention`` call (GQA heads share their kv head without
copies), and masked positions contribute exact zeros. A row therefore sees the same
shapes and the same arithmetic whatever else is in the batch, which keeps results
batch-invariant. Long prefill rows, which carry many tokens each, go through
``scaled_dot_product_attention`` per sequence.
"""

from __future__ import annotations

from collections import defaultdict

import attrs
import torch
import torch.nn.functional as F

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, KVCacheSpec, LayerKVCache

#: Short rows' keys are padded to a multiple of this many (a multiple of common block sizes).
BUCKET = 64
#: Rows with at most this many new tokens attend batched; longer ones one at a time.
SHORT_QUERY = 16
#: Every multi-token short row is padded to at least this many query slots.
MIN_QUERY_WIDTH = 8


def query_width(query_len: int) -> int:
    """Decodes stay one wide; every other short row is padded to 8 or 16 query slots.

    Verification rows of 2-6 tokens (a token and its drafts) would otherwise split each
    key bucket into widths 2, 4 and 8, one attention call each: with DSpark's ragged
    lengths at 64 sequences that cost more than the padded slots (on a 2-core CPU,
    DSpark / best fixed-k at concurrency 64 went from 0.95 to 1.06).
    """
    if query_len == 1:
        return 1
    return max(MIN_QUERY_WIDTH, 1 << (query_len - 1).bit_length())


@attrs.frozen
class _ShortGroup:
    """The short rows of one key bucket and query width, and what attending over them needs."""

    tokens: torch.Tensor  # int64 [r, width_q]: each query slot's flat token (padding repeats the row's last)
    kept: torch.Tensor  # int64 [n]: the real query slots among the flattened [r * width_q]
    kept_tokens: torch.Tensor  # int64 [n]: their flat tokens
    blocks: torch.Tensor  # int64 [r * blocks_per_row]: each row's blocks, padded with block 0
    visible: torch.Tensor  # bool [r, 1, width_q, width]: the keys each query slot attends to
    tail: int  # first key column that lies past the end of some row
    stale: torch.Tensor  # bool [r, width - tail, 1, 1]: key columns from ``tail`` on past the row's end

    @classmethod
    def plan(cls, metadata: AttentionMetadata, sliding_window: int | None, causal: bool) -> list[_ShortGroup]:
        starts, seq_lens = metadata.query_start_loc_host, metadata.seq_lens_host
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for row, query_len in enumerate(metadata.query_lens_host):
            if query_len <= SHORT_QUERY:
                groups[(-(-seq_lens[row] // BUCKET), query_width(query_len))].append(row)
        device = metadata.seq_lens.device
        plan = []
        for (bucket, width_q), rows in sorted(groups.items()):
            num_blocks = -(-bucket * BUCKET // metadata.block_size)
            table = metadata.block_tables[torch.tensor(rows, device=device)].to(torch.long)
            if table.shape[1] < num_blocks:  # the bucket reaches past the table: those keys are masked
                table = F.pad(table, (0, num_blocks - table.shape[1]))
            start = torch.tensor([starts[r] for r in rows], device=device)
            query_len = torch.tensor([starts[r + 1] - starts[r] for r in rows], device=device)
            seq_len = torch.tensor([seq_lens[r] for r in rows], device=device)
            slot = torch.arange(width_q, device=device)
            offset = torch.minimum(slot[None, :], query_len[:, None] - 1)  # [r, width_q]
            query_pos = (seq_len - query_len)[:, None] + offset
            key_pos = torch.arange(num_blocks * metadata.block_size, device=device)
            if causal:
                visible = key_pos[None, None, :] <= query_pos[:, :, None]
                if sliding_window is not None:
                    visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
            else:  # the same keys for every new token (interfaces.attention: AttentionLayerSpec.causal)
                first = seq_len - query_len - sliding_window if sliding_window is not None else 0 * seq_len
                seen = (key_pos[None, :] < seq_len[:, None]) & (key_pos[None, :] >= first[:, None])
                visible = seen[:, None, :].expand(-1, width_q, -1)
            real = (slot[None, :] < query_len[:, None]).flatten()
            tail = (bucket - 1) * BUCKET
            plan.append(
                cls(
                    tokens=start[:, None] + offset,
                    kept=real.nonzero().flatten(),
                    kept_tokens=(start[:, None] + offset).flatten()[real],
                    blocks=table[:, :num_blocks].flatten(),
                    visible=visible[:, None],
                    tail=tail,
                    stale=(key_pos[None, tail:] >= seq_len[:, None])[:, :, None, None],
                )
            )
        return plan


class BucketedAttention:
    name = "torch-bucketed"

    def __init__(self) -> None:
        # Reused gather buffers: a fresh multi-megabyte tensor per layer costs page faults
        # that take longer than the copy itself. One step thread uses a backend at a time.
        self._scratch: dict[str, torch.Tensor] = {}
        # The short-row plan of the step being run, per sliding window and mask kind (see _short_plan).
        self._plans: tuple[AttentionMetadata | None, dict[tuple[int | None, bool], list[_ShortGroup]]] = (None, {})

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
        self.store_kv(layer, key, value, kv_cache, metadata)
        return self._attend(layer, query, kv_cache["key"], kv_cache["value"], metadata)

    def store_kv(
        self,
        layer: AttentionLayerSpec,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """``KVStoreAttentionBackend``: the cache write of ``forward``, nothing attended."""
        metadata.store(kv_cache["key"], key)
        metadata.store(kv_cache["value"], value)

    def _attend(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [tokens, heads, dim]
        key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, dim], this step's keys stored
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        output = torch.zeros_like(query)
        self._short(layer, query, key_cache, value_cache, metadata, output)
        starts = metadata.query_start_loc_host
        keys, values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # [slots, kv_heads, dim]
        for i, query_len in enumerate(metadata.query_lens_host):
            if query_len > SHORT_QUERY:
                start, end = starts[i], starts[i + 1]
                output[start:end] = self._prefill(layer, query[start:end], keys, values, metadata, i)
        return output

    def _short(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [tokens, heads, dim]
        key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,  # [tokens, heads, dim]: the short rows' tokens are written
    ) -> None:
        heads, dim = query.shape[1:]
        kv_heads = layer.num_kv_heads
        group_size = heads // kv_heads
        # The query heads that share a kv head are that head's query rows (each query
        # token's ``group_size`` heads share its mask), so each kv head is read once.
        grouped = query.view(-1, kv_heads, group_size, dim)
        for group in self._short_plan(metadata, layer.sliding_window, layer.causal):
            rows, width_q = group.tokens.shape
            keys = self._gather_blocks("key", key_cache, group.blocks, rows)
            values = self._gather_blocks("value", value_cache, group.blocks, rows)
            # Slots past a sequence's end hold stale or never-written memory: keep it out of
            # the sums entirely (a masked NaN score, or 0 * NaN, would still be NaN). Only the
            # last bucket's worth of columns can lie past any of these rows' ends.
            keys[:, group.tail :].masked_fill_(group.stale, 0.0)
            values[:, group.tail :].masked_fill_(group.stale, 0.0)
            # [r, width_q, kv, g, d] -> [r, kv, width_q * g, d]: slot t's heads are rows t*g..t*g+g-1.
            queries = grouped[group.tokens].transpose(1, 2).reshape(rows, kv_heads, width_q * group_size, dim)
            visible = group.visible if width_q == 1 else group.visible.repeat_interleave(group_size, dim=2)
            attended = F.scaled_dot_product_attention(
                queries,
                keys.transpose(1, 2).to(query.dtype),  # [r, kv_heads, width, dim]
                values.transpose(1, 2).to(query.dtype),
                attn_mask=visible,
                scale=layer.scale,
            )
            slots = attended.view(rows, kv_heads, width_q, group_size, dim).transpose(1, 2)
            output[group.kept_tokens] = slots.reshape(rows * width_q, heads, dim)[group.kept]

    def _short_plan(self, metadata: AttentionMetadata, sliding_window: int | None, causal: bool) -> list[_ShortGroup]:
        """Rows, blocks and masks of each short-row group: the same for every layer of a
        step, so built once per step (and window and mask kind) and reused."""
        if self._plans[0] is not metadata:
            self._plans = (metadata, {})
        plans = self._plans[1]
        if (sliding_window, causal) not in plans:
            plans[(sliding_window, causal)] = _ShortGroup.plan(metadata, sliding_window, causal)
        return plans[(sliding_window, causal)]

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
        gqa = layer.num_heads != layer.num_kv_heads
        if layer.causal and q_len == seq_len and (layer.sliding_window is None or layer.sliding_window >= seq_len):
            # The whole sequence is new and plainly causal: torch's causal kernel skips the
            # blocks above the diagonal, where a mask would be built per layer, turned into
            # a float mask, and applied to every block. (``is_causal`` aligns the diagonal
            # top-left, so a chunk after cached tokens keeps the mask.)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=gqa)
            return out.transpose(0, 1)
        query_pos = positions[seq_len - q_len :, None]
        if layer.causal:
            mask = positions[None, :] <= query_pos
            if layer.sliding_window is not None:
                mask = mask & (positions[None, :] > query_pos - layer.sliding_window)
        else:  # the same keys for every new token: the window before the first, and all new ones
            first = seq_len - q_len - (layer.sliding_window if layer.sliding_window is not None else seq_len)
            mask = (positions[None, :] >= first).expand(q_len, seq_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
        return out.transpose(0, 1)
