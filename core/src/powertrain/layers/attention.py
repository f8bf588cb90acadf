"""The attention call of a GQA/MHA layer: hand q/k/v to the chosen backend.

The projections and rotary live in the model file, which knows the checkpoint's
layout; this layer only carries the static ``AttentionLayerSpec`` and calls the
backend object assembly built, through its Protocol (no pluggy on this path).
"""

from __future__ import annotations

import torch
from torch import nn

from powertrain.interfaces import AttentionBackend, AttentionLayerSpec, AttentionMetadata, LayerKVCache


class Attention(nn.Module):
    def __init__(self, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        output = self.backend.forward(self.spec, query, key, value, kv_cache, metadata)
        return output.flatten(1)

    def extra_repr(self) -> str:
        s = self.spec
        text = f"backend={self.backend.name}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_size={s.head_size}"
        return text + (f", sliding_window={s.sliding_window}" if s.sliding_window else "")
