"""The reference attention backend: paged GQA/MHA and MLA attention in plain torch.

It is the oracle every other backend is measured against (the conformance kit
compares them token by token), so it favours obvious correctness over speed: one
loop over sequences, each sequence's keys gathered from the paged cache into a
dense tensor, scores by matmul with an explicit causal mask, float32 arithmetic for
half-precision inputs. It runs wherever torch runs.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)
from powertrain.layers.compressed_attention import attend_window_and_entries
from powertrain.layers.indexer import index_topk_reference


class TorchReferenceAttention:
    """Satisfies ``AttentionBackend``, ``MLAAttentionBackend``, ``SparseMLAAttentionBackend``,
    ``V4AttentionBackend`` and ``LightningIndexerBackend`` (see interfaces.attention)."""

    name = "torch-reference"

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """Block-token-major ``key``/``value`` for GQA; only ``latent`` and ``rope`` for MLA."""
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
        """Write this step's key/value at ``slot_mapping``, then attend causally per sequence."""
        if layer.kind != "gqa":
            raise ValueError(f"forward() serves GQA/MHA layers; an {layer.kind!r} layer goes through forward_mla()")
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(f"num_heads={layer.num_heads} is not a multiple of num_kv_heads={layer.num_kv_heads}")
        self.store_kv(layer, key, value, kv_cache, metadata)
        key_cache, value_cache = kv_cache["key"], kv_cache["value"]

        compute = _compute_dtype(query.dtype)
        # Zeros, not empty: rows past the batch's tokens (padding) must not be garbage.
        output = torch.zeros_like(query)
        for i, (start, end) in enumerate(pairwise(metadata.query_start_loc_host)):
            seq_len = metadata.seq_lens_host[i]
            keys = _gather_sequence(key_cache, metadata, i, seq_len).to(compute)
            values = _gather_sequence(value_cache, metadata, i, seq_len).to(compute)
            output[start:end] = _attend(
                query[start:end].to(compute),
                keys,
                values,
                context_len=seq_len - (end - start),
                scale=layer.scale,
                sliding_window=layer.sliding_window,
                causal=layer.causal,
            ).to(output.dtype)
        return output

    def store_kv(
        self,
        layer: AttentionLayerSpec,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """``KVStoreAttentionBackend``: the cache write of ``forward``, nothing attended."""
        if layer.kind != "gqa":
            raise ValueError(f"store_kv() writes GQA/MHA caches; an {layer.kind!r} layer's goes through its forward")
        metadata.store(kv_cache["key"], key)
        metadata.store(kv_cache["value"], value)

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
        """Absorbed MLA: scores over [latent | rope], values are the latent itself.

        Concatenating ``q_latent|q_rope`` against ``latent|rope`` gives exactly
        ``q_latent·latent + q_rope·k_rope`` in one matmul, and the single latent
        "kv head" is shared by every query head, which is GQA with one group.
        """
        if layer.kind != "mla":
            raise ValueError(f"forward_mla() serves MLA layers, got a {layer.kind!r} layer")
        latent_cache, rope_cache = kv_cache["latent"], kv_cache["rope"]
        metadata.store(latent_cache, latent)
        metadata.store(rope_cache, k_rope)

        compute = _compute_dtype(q_latent.dtype)
        num_tokens, num_heads, rank = q_latent.shape
        output = q_latent.new_zeros((num_tokens, num_heads, rank))
        for i, (start, end) in enumerate(pairwise(metadata.query_start_loc_host)):
            seq_len = metadata.seq_lens_host[i]
            cached_latent = _gather_sequence(latent_cache, metadata, i, seq_len).to(compute)
            cached_rope = _gather_sequence(rope_cache, metadata, i, seq_len).to(compute)
            query = torch.cat([q_latent[start:end], q_rope[start:end]], dim=-1).to(compute)
            keys = torch.cat([cached_latent, cached_rope], dim=-1).unsqueeze(1)  # one shared kv head
            output[start:end] = _attend(
                query,
                keys,
                cached_latent.unsqueeze(1),
                context_len=seq_len - (end - start),
                scale=layer.scale,
                sliding_window=layer.sliding_window,
                causal=layer.causal,
            ).to(output.dtype)
        return output

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
        """Sparse MLA (DSA): each token attends to the positions its ``indices`` row lists.

        The indices are checked before the cache is written, so a refused step leaves
        it as it was. Positions go through the token's own sequence's block table to
        slots, the selected latent/rope rows are gathered (one ``[topk]`` set per
        token, not per sequence, hence no loop), and -1 entries are masked out of the
        softmax; a row with none left outputs zeros rather than NaN.
        """
        if layer.kind != "mla":
            raise ValueError(f"forward_mla_sparse() serves MLA layers, got a {layer.kind!r} layer")
        metadata.check_sparse_indices(indices)
        latent_cache, rope_cache = kv_cache["latent"], kv_cache["rope"]
        metadata.store(latent_cache, latent)
        metadata.store(rope_cache, k_rope)

        compute = _compute_dtype(q_latent.dtype)
        num_tokens, num_heads, rank = q_latent.shape
        output = q_latent.new_zeros((num_tokens, num_heads, rank))
        real = metadata.num_tokens
        if real == 0:
            return output
        device = q_latent.device
        sequence = torch.repeat_interleave(
            torch.arange(metadata.batch_size, device=device),
            torch.tensor(metadata.query_lens_host, device=device),
        )  # [real]: the sequence of each query token
        chosen = indices[:real].to(device=device, dtype=torch.long)
        valid = chosen >= 0
        positions = chosen.clamp(min=0)  # padding reads position 0, then is masked out
        block_size = metadata.block_size
        blocks = metadata.block_tables.to(device=device, dtype=torch.long)[sequence[:, None], positions // block_size]
        slots = blocks * block_size + positions % block_size  # [real, topk]
        selected_latent = latent_cache.view(-1, rank)[slots].to(compute)  # [real, topk, rank]
        selected_rope = rope_cache.view(-1, rope_cache.shape[-1])[slots].to(compute)

        scores = torch.einsum("thr,tkr->thk", q_latent[:real].to(compute), selected_latent)
        scores = (scores + torch.einsum("thr,tkr->thk", q_rope[:real].to(compute), selected_rope)) * layer.scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(valid.any(dim=-1)[:, None, None], probs, 0.0)  # all -1: softmax of -inf is NaN
        output[:real] = torch.einsum("thk,tkr->thr", probs, selected_latent).to(output.dtype)
        return output

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
        """DeepSeek-V4 attention: V4's own torch computation, which transformers is checked against."""
        return attend_window_and_entries(
            layer,
            query,
            kv_cache,
            metadata,
            sinks,
            window=window,
            compress_rate=compress_rate,
            entry_indices=entry_indices,
            derotate=derotate,
        )

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
        """The Lightning Indexer's scores and top-k, sequence by sequence in torch."""
        return index_topk_reference(query, weights, keys, metadata, topk=topk, tokens_per_entry=tokens_per_entry)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax loses too much to serve as an oracle; float64 stays float64
    # so tests can run the reference at full precision.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather_sequence(cache: torch.Tensor, metadata: AttentionMetadata, index: int, seq_len: int) -> torch.Tensor:
    """Sequence ``index``'s first ``seq_len`` cached tokens, in position order."""
    num_blocks = -(-seq_len // metadata.block_size)
    blocks = metadata.block_tables[index, :num_blocks].to(torch.long)
    return cache[blocks].flatten(0, 1)[:seq_len]


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    context_len: int,
    scale: float,
    sliding_window: int | None,
    causal: bool = True,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over all its tokens.

    ``query`` [q_len, heads, dk]; ``keys`` [seq_len, kv_heads, dk]; ``values``
    [seq_len, kv_heads, dv]. Query head ``h`` reads kv head ``h // (heads // kv_heads)``;
    grouping the query heads per kv head lets one broadcast matmul serve GQA, MHA and
    MLA without copying keys per head. New token ``j`` sits at position
    ``context_len + j`` and sees positions up to its own; with a sliding window it sees
    only the last ``sliding_window`` of them (itself included), the Mistral/HF rule.
    Not ``causal``: every new token sees every new token, and the window (if any) is the
    ``sliding_window`` cached tokens before the first new one, the same for all of them.
    """
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kv, group, q_len, dk]
    k = keys.permute(1, 0, 2).unsqueeze(1)  # [kv, 1, seq_len, dk]
    v = values.permute(1, 0, 2).unsqueeze(1)  # [kv, 1, seq_len, dv]

    query_pos = torch.arange(context_len, context_len + q_len, device=query.device)[:, None]
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    if causal:
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible = visible & (key_pos > query_pos - sliding_window)
    else:
        first = context_len - (seq_len if sliding_window is None else sliding_window)
        visible = (key_pos >= first).expand(q_len, seq_len)

    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [kv, group, q_len, dv]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, values.shape[-1])
