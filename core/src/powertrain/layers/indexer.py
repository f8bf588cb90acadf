"""DeepSeek-V3.2's Lightning Indexer: which earlier tokens each query's sparse attention reads.

Every V3.2 attention layer has one. It scores each visible token ``t`` for a query ``s`` as

    I[s, t] = sum_h  w[s, h] * n_heads**-0.5 * ReLU(softmax_scale * q[s, h] . k[t])

with ``n_heads`` cheap query heads, ONE key per token (shared by the heads, so the cache holds one
``index_head_dim`` vector per token, apart from MLA's latent) and per-query head weights ``w``
computed from the hidden state; the MLA attention then reads only the ``index_topk`` best tokens.

The split follows what the engine needs: ``keys`` turns the new tokens into the keys to store
(a cache group), ``queries`` and ``head_weights`` give what ``LightningIndexerBackend.index_topk``
scores them with (a backend's kernel, or ``index_topk_reference`` here); ``select`` does the same
over dense per-sequence keys.

Followed from transformers 5.24 ``DeepseekV32Indexer`` (the oracle; parameter names are its own,
so ``model.layers.{i}.self_attn.indexer.<name>`` maps 1:1):

- q input: the MLA's q-LoRA residual ``q_a_layernorm(q_a_proj(x))`` (normalised, before
  ``q_b_proj``), through ``wq_b`` -> ``[n_heads, index_head_dim]``. The key and the head weights
  come from the layer's input hidden state ``x`` (after ``input_layernorm``).
- k: ``k_norm(wk(x))``, ``k_norm`` a LayerNorm with bias (eps 1e-6), not an RMSNorm.
- RoPE on the FIRST ``qk_rope_head_dim`` dims (MLA puts its rope dims last), rotate-half, i.e.
  NOT interleaved, unlike MLA's rope; same cos/sin table as MLA (YaRN frequencies and its
  ``attention_factor`` included), cast to the activation dtype as HF does.
- scores in float32 (q and k upcast), ``softmax_scale = index_head_dim**-0.5`` before the ReLU,
  head weights ``weights_proj(x).float() * n_heads**-0.5``; no softmax anywhere.
- top-k over visible tokens (key position <= query position), ``min(index_topk, seq_len)``.
  HF then returns indices of masked (-inf) tokens too when fewer than ``index_topk`` are
  visible (they are dropped again by the causal mask); here those slots are -1.

Unchecked against DeepSeek's own inference code (``inference/model.py`` of V3.2-Exp, not
available here), where it may differ: it applies a Hadamard transform to q and k and quantises
both to FP8 (per-token scale) before the dot product (the transform is orthogonal, so only the
FP8 rounding changes scores); it may compute ``weights_proj`` in float32 and fold
``softmax_scale`` and the q scale into the head weights after the ReLU (equal for positive
scales); whether its rope for the indexer is non-interleaved in every released version is
taken from HF's comment, not verified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from powertrain.interfaces import AttentionMetadata
from powertrain.interfaces.attention import score_rows
from powertrain.layers.paged import read_entries
from powertrain.layers.rotary import apply_rotary


class LightningIndexer(nn.Module):
    """The indexer of one V3.2 attention layer, for a flat batch of query tokens (see module doc)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        rope_head_dim: int,
        topk: int,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if rope_head_dim > head_dim:
            raise ValueError(f"rope_head_dim {rope_head_dim} exceeds the indexer head_dim {head_dim}")
        self.n_heads, self.head_dim, self.rope_head_dim, self.topk = n_heads, head_dim, rope_head_dim, topk
        self.softmax_scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LightningIndexer:
        """From a V3.2 ``config.json`` dict (``index_n_heads``, ``index_head_dim``, ``index_topk``)."""
        return cls(
            hidden_size=config["hidden_size"],
            q_lora_rank=config["q_lora_rank"],
            n_heads=config["index_n_heads"],
            head_dim=config["index_head_dim"],
            rope_head_dim=config["qk_rope_head_dim"],
            topk=config["index_topk"],
        )

    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``[n, head_dim]`` (activation dtype) of tokens ``hidden`` ``[n, hidden_size]``;
        ``cos``/``sin`` ``[n, rope_head_dim // 2]`` at their positions (``RotaryEmbedding``'s output)."""
        k = self.k_norm(self.wk(hidden))
        return apply_rotary(k.unsqueeze(1), cos, sin).squeeze(1)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated query heads ``[n, n_heads, head_dim]`` from the q-LoRA residual ``[n, q_lora_rank]``."""
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.n_heads, self.head_dim)
        return apply_rotary(q, cos, sin)

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, n_heads]``: ``weights_proj(x) * n_heads**-0.5 * softmax_scale``, every
        scale of the score folded in (the ReLU commutes with a positive scale), as
        ``LightningIndexerBackend.index_topk`` takes them."""
        weights = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float()
        return weights * (self.n_heads**-0.5 * self.softmax_scale)

    def scores(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """float32 index scores ``[n, T]`` of ``n`` queries against ``keys`` ``[T, head_dim]``, unmasked."""
        return index_scores(self.queries(q_resid, cos, sin), self.head_weights(hidden), keys)

    def select(
        self,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        query_start_loc: Sequence[int],
        cached_keys: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """int32 ``[n, width]``: per query, the positions of its ``topk`` best visible tokens, best first,
        -1 in the slots left when fewer than ``topk`` are visible. ``width`` is ``topk``, or the
        longest sequence's length when that is shorter: no column would hold anything but -1, and
        sparse attention gathers a row per column.

        Sequence ``i`` owns queries ``query_start_loc[i]:query_start_loc[i + 1]`` (host ints) and its
        keys are ``cached_keys[i]`` ``[seq_len, head_dim]``, row ``t`` the key of position ``t``, the
        new tokens' own keys included. A query at position ``p`` sees rows ``0..p``. (The engine
        reads the keys from its paged cache instead: ``index_topk_reference``.)
        """
        if len(query_start_loc) != len(cached_keys) + 1:
            raise ValueError(f"{len(cached_keys)} sequences of keys but query_start_loc {tuple(query_start_loc)}")
        width = max(1, min(self.topk, max((keys.shape[0] for keys in cached_keys), default=1)))
        indices = torch.full((hidden.shape[0], width), -1, dtype=torch.int32, device=hidden.device)
        for seq, keys in enumerate(cached_keys):
            start, end = query_start_loc[seq], query_start_loc[seq + 1]
            if start == end or keys.shape[0] == 0:
                continue
            scores = self.scores(hidden[start:end], q_resid[start:end], cos[start:end], sin[start:end], keys)
            indices[start:end] = best_visible(scores, positions[start:end], width, tokens_per_entry=1)
        return indices

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, rope_head_dim={self.rope_head_dim}, topk={self.topk}"


def index_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, T]``: ``sum_h weights[:, h] * ReLU(query[:, h] . keys[t])`` for rotated
    queries ``[n, n_heads, d]``, folded head weights ``[n, n_heads]`` and keys ``[T, d]``."""
    per_head = torch.relu(torch.einsum("nhd,td->nht", query.float(), keys.float()))
    return torch.einsum("nh,nht->nt", weights.float(), per_head)


def best_visible(scores: torch.Tensor, positions: torch.Tensor, width: int, tokens_per_entry: int) -> torch.Tensor:
    """int32 ``[n, width]``: each row's best keys among those visible from its position
    (``s < (p + 1) // tokens_per_entry``), best first, -1 in the columns left."""
    visible = (positions[:, None] + 1) // tokens_per_entry > torch.arange(scores.shape[1], device=scores.device)
    best, chosen = scores.masked_fill(~visible, float("-inf")).topk(min(width, scores.shape[1]), dim=-1)
    picked = torch.full((scores.shape[0], width), -1, dtype=torch.int32, device=scores.device)
    picked[:, : chosen.shape[1]] = chosen.masked_fill(best == float("-inf"), -1).to(torch.int32)
    return picked


def index_topk_reference(
    query: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    topk: int,
    tokens_per_entry: int = 1,
) -> torch.Tensor:
    """``LightningIndexerBackend.index_topk`` in plain torch (see there), one sequence at a
    time: its keys gathered densely, scored, masked, top-k. What the reference backend
    runs, and what an indexer runs on a backend without the capability."""
    width = max(1, min(topk, metadata.max_seq_len // tokens_per_entry))
    picked = torch.full((query.shape[0], width), -1, dtype=torch.int32, device=query.device)
    for seq, seq_len in enumerate(metadata.seq_lens_host):
        start, end = metadata.query_start_loc_host[seq], metadata.query_start_loc_host[seq + 1]
        count = seq_len // tokens_per_entry
        if start == end or count == 0:
            continue
        cached = read_entries(keys, metadata.block_tables[seq], 0, count)
        positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        step = score_rows(count)
        for first in range(start, end, step):
            last = min(first + step, end)
            scores = index_scores(query[first:last], weights[first:last], cached)
            picked[first:last] = best_visible(scores, positions[first - start : last - start], width, tokens_per_entry)
    return picked
