"""A token embedding whose table can stay quantised: a step dequantises only its tokens' rows."""

from __future__ import annotations

import torch
from torch import nn

from powertrain.interfaces import QuantizedWeight


class Embedding(nn.Embedding):
    """``nn.Embedding`` that ``use_quantized`` switches to a table kept quantised.

    A GGUF model's embedding is often its largest matrix (SmolLM2's is 49152 x 576, a fifth
    of the model): kept as stored, it costs a quarter of its float32 bytes, and a lookup
    expands just the rows it returns. ``weight`` is None afterwards.
    """

    quantized: QuantizedWeight | None = None

    def use_quantized(self, table: QuantizedWeight, dtype: torch.dtype) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if table.shape != expected:
            raise ValueError(f"a quantised embedding of shape {list(table.shape)} for a {list(expected)} table")
        self.quantized, self.dtype = table, dtype
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return super().forward(input_ids)
        rows = self.quantized.select_rows(input_ids.reshape(-1)).dequantize(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)
