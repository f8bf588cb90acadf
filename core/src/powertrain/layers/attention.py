"""The attention calls of GQA/MHA and MLA layers: hand their inputs to the chosen backend.

The projections and rotary live in the model file, which knows the checkpoint's
layout; this layer only carries the static ``AttentionLayerSpec`` and calls the
backend object assembly built, through its Protocol (no pluggy on this path).
"""

from __future__ import annotations

import torch
from torch import nn

from powertrain.interfaces import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    KVStoreAttentionBackend,
    LayerKVCache,
    MLAAttentionBackend,
    RotaryAttentionBackend,
)
from powertrain.layers.rotary import apply_rotary


class Attention(nn.Module):
    """GQA/MHA attention; given ``rotary=(cos, sin)`` it rotates query and key first, or
    lets a ``fused-rotary`` backend do that together with its cache write."""

    def __init__(self, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.fused_rotary = isinstance(backend, RotaryAttentionBackend)
        #: Whether ``store`` writes keys and values without attending (capability ``kv-store``).
        self.stores_only = isinstance(backend, KVStoreAttentionBackend)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) per token
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        metadata = metadata.for_window(self.spec.sliding_window)  # this layer's block tables
        if rotary is None:
            output = self.backend.forward(self.spec, query, key, value, kv_cache, metadata)
        elif self.fused_rotary:
            output = self.backend.forward_rotary(self.spec, query, key, value, *rotary, kv_cache, metadata)
        else:
            cos, sin = rotary
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            output = self.backend.forward(self.spec, query, key, value, kv_cache, metadata)
        return output.flatten(1)

    def store(
        self,
        query: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write this step's keys and values where ``forward`` would, for rows whose attention
        output nobody reads (a block drafter's context): without attending on a ``kv-store``
        backend (``query`` unused, may be None), else through ``forward``, its output dropped."""
        if not self.stores_only:
            assert query is not None, "a backend without kv-store attends to write: it needs the query"
            self.forward(query, key, value, kv_cache, metadata, rotary)
            return
        if rotary is not None:
            key = apply_rotary(key, *rotary)
        self.backend.store_kv(self.spec, key, value, kv_cache, metadata.for_window(self.spec.sliding_window))

    def extra_repr(self) -> str:
        s = self.spec
        text = f"backend={self.backend.name}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_size={s.head_size}"
        return text + (f", sliding_window={s.sliding_window}" if s.sliding_window else "")


class MLAAttention(nn.Module):
    """The attention call of an MLA layer, in the weight-absorbed form.

    The model hands over queries already projected into the latent space plus their
    rope part, and this step's normalised latents and rotated rope keys; the backend
    writes the latent cache and returns per-head latent outputs, which the model
    up-projects through ``kv_b_proj``'s value rows.
    """

    def __init__(self, spec: AttentionLayerSpec, backend: MLAAttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend

    def forward(
        self,
        q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]
        q_rope: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim]
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank]
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
        metadata = metadata.for_window(self.spec.sliding_window)
        return self.backend.forward_mla(self.spec, q_latent, q_rope, latent, k_rope, kv_cache, metadata)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"backend={self.backend.name}, heads={s.num_heads}, "
            f"kv_lora_rank={s.kv_lora_rank}, rope={s.qk_rope_head_dim}"
        )


class SparseMLAAttention(MLAAttention):
    """``MLAAttention`` for DeepSeek-V3.2: each query attends only to the positions its
    row of ``indices`` lists (int32 ``[num_tokens, topk]``, -1 padding), through the
    backend's ``forward_mla_sparse``; no causal mask beyond what the indices say."""

    def forward(  # type: ignore[override]
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        indices: torch.Tensor,
    ) -> torch.Tensor:
        metadata = metadata.for_window(self.spec.sliding_window)
        return self.backend.forward_mla_sparse(self.spec, q_latent, q_rope, latent, k_rope, kv_cache, metadata, indices)
