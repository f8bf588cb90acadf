"""DeepSeek-V4's attention parts, for a flat batch of tokens: interleaved partial RoPE, the
KV compressors (CSA's overlapping windows, HCA's plain ones), the compressed Lightning
Indexer, and attention with per-head sinks over a window of raw keys plus compressed ones.

The split follows what a paged engine needs (docs/deepseek_v4_notes.md §3): a compressor
turns each token into a *row* (its projections and gate logits) that is cached per token,
and an *entry* is computed from the rows of its window once the window's last token
arrives; entries are cached one per ``rate`` tokens. Nothing depends on how a prompt was
chunked, so prefix caching, preemption and rollback need no state of their own.

Followed from transformers 5.24 ``modeling_deepseek_v4`` (the oracle; parameter names are
DeepSeek's native ones, as its checkpoints store them): where DeepSeek's own inference code
differs (an FP8/FP4 quantise-dequantise simulation of the entries and indexer keys, a
Hadamard rotation of the indexer's q and k), transformers is followed, as the notes say.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, LayerKVCache
from powertrain.layers.linear import Linear
from powertrain.layers.paged import read_entries


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's RoPE: rotate the trailing ``2 * cos.shape[-1]`` dims of ``x`` as adjacent pairs
    ``(x[2i], x[2i+1])``, in float32, leaving the leading dims as they are. ``cos``/``sin``
    broadcast against ``x[..., 0::2]`` of the rope part (e.g. ``[n, 1, r/2]`` for heads);
    ``-sin`` undoes the rotation (V4 de-rotates its attention output)."""
    width = 2 * cos.shape[-1]
    nope, rope = x[..., :-width], x[..., -width:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


class V4RMSNorm(nn.Module):
    """DeepSeek-V4's RMSNorm: the weight stays float32 and multiplies before the cast back
    (transformers' ``DeepseekV4RMSNorm``), unlike Llama's, which casts first."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """One entry per ``rate`` tokens, of width ``head_dim``.

    ``overlap`` (CSA and its indexer): each token projects to two halves; entry ``w``
    softmax-mixes, per channel, the first halves of window ``w - 1``'s rows with the second
    halves of window ``w``'s (2·rate slots). Without (HCA): the rows of window ``w`` alone.
    Then the norm, then RoPE at position ``w * rate`` (the caller's "compress" table).
    """

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(hidden_size, width, bias=False)
        self.wgate = Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = V4RMSNorm(head_dim, eps)

    @property
    def row_width(self) -> int:
        """Floats a token's row takes: its projections, then its gate logits."""
        return 2 * self.wkv.out_features

    @property
    def window_tokens(self) -> int:
        """The rows an entry reads: its own window's, and with overlap the one before."""
        return (2 if self.overlap else 1) * self.rate

    def rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, row_width]``: ``[wkv(x) | wgate(x) + ape[position mod rate]]``."""
        gate = self.wgate(hidden).float() + self.ape[positions % self.rate]
        return torch.cat((self.wkv(hidden).float(), gate), dim=-1)

    def entries(self, rows: torch.Tensor, first: int, dtype: torch.dtype) -> torch.Tensor:
        """Entries ``first, first + 1, ...`` (before RoPE), ``[windows, head_dim]`` in ``dtype``,
        from the rows of their windows in position order: positions from ``first * rate``
        (with overlap, from the window before, when there is one) to the last window's end."""
        kv, gate = rows.float().split(self.wkv.out_features, dim=-1)
        if self.overlap and first == 0:  # window 0 has no earlier window: slots of weight 0
            kv = torch.cat((kv.new_zeros(self.rate, kv.shape[1]), kv))
            gate = torch.cat((gate.new_full((self.rate, gate.shape[1]), float("-inf")), gate))
        if kv.shape[0] % self.rate:
            raise ValueError(f"compressed entries need whole windows of {self.rate} rows, got {rows.shape[0]}")
        kv, gate = kv.view(-1, self.rate, kv.shape[1]), gate.view(-1, self.rate, gate.shape[1])
        if self.overlap:  # each entry's rows: the window before's, then its own
            kv, gate = torch.cat((kv[:-1], kv[1:]), dim=1), torch.cat((gate[:-1], gate[1:]), dim=1)
        return self._mix(kv, gate, dtype)

    def window_entries(self, rows: torch.Tensor, present: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One entry per row of ``rows`` ``[n, window_tokens, row_width]``, each its window's
        rows (with overlap, the window before's first) in position order; ``present``
        ``[n, window_tokens]`` is False for slots before position 0 (weight 0)."""
        kv, gate = rows.float().split(self.wkv.out_features, dim=-1)
        absent = ~present[..., None]
        return self._mix(kv.masked_fill(absent, 0.0), gate.masked_fill(absent, float("-inf")), dtype)

    def _mix(self, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries ``[windows, head_dim]`` from each window's ``[windows, window_tokens, width]``
        rows: with overlap, the first halves of the window before's rows and the second
        halves of its own; the gates' softmax over the slots weighs them, then the norm."""
        if self.overlap:
            d, rate = self.head_dim, self.rate
            kv = torch.cat((kv[:, :rate, :d], kv[:, rate:, d:]), dim=1)
            gate = torch.cat((gate[:, :rate, :d], gate[:, rate:, d:]), dim=1)
        weights = gate.softmax(dim=1).to(dtype)
        return self.norm((kv.to(dtype) * weights).sum(dim=1))


class CompressedIndexer(nn.Module):
    """CSA's Lightning Indexer: picks, per query, the ``topk`` compressed entries its
    attention reads. Keys come from its own overlapping compressor (``index_head_dim`` wide);
    a query's score for entry ``s`` is ``sum_h w[h] * ReLU(q[h] . k[s]) * head_dim**-0.5``
    with ``w = weights_proj(x) * n_heads**-0.5``, in float32."""

    def __init__(
        self, *, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int, topk: int, eps: float
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.compressor = Compressor(hidden_size, head_dim, rate, overlap=True, eps=eps)
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = Linear(hidden_size, n_heads, bias=False)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated index queries ``[n, n_heads, head_dim]`` from the q-LoRA residual; ``cos``/``sin``
        ``[n, r/2]``, the "compress" table at the query positions."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        return rotate_trailing(q, cos.unsqueeze(1), sin.unsqueeze(1))

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, n_heads]``: ``weights_proj(x) * n_heads**-0.5 * head_dim**-0.5``, every
        scale of the score folded in (the ReLU commutes with a positive scale)."""
        return self.weights_proj(hidden).float() * (self.n_heads**-0.5 * self.head_dim**-0.5)


def attend_with_sinks(
    query: torch.Tensor,  # [n, heads, d], rotated
    keys: torch.Tensor,  # [k, d]: one shared head, also the values
    allowed: torch.Tensor,  # bool [n, k]
    sinks: torch.Tensor,  # float32 [heads]
    scale: float,
    picked: tuple[torch.Tensor, torch.Tensor] | None = None,  # [n, p, d] each query's own keys, bool [n, p]
) -> torch.Tensor:
    """Shared-KV multi-query attention with one sink logit per head: softmax over the
    allowed keys (and each query's ``picked`` ones) and the sink, the sink's share dropped
    (so rows may sum to less than 1). ``[n, heads, d]`` in ``query``'s dtype."""
    # The scores in the activation dtype, the softmax with the float32 sinks in float32 (as
    # transformers' eager attention promotes them when it appends the sink column).
    logits = [(torch.einsum("nhd,kd->nhk", query, keys) * scale).float().masked_fill(~allowed[:, None, :], -torch.inf)]
    if picked is not None:
        own, own_allowed = picked
        own_logits = (torch.einsum("nhd,npd->nhp", query, own) * scale).float()
        logits.append(own_logits.masked_fill(~own_allowed[:, None, :], -torch.inf))
    logits.append(sinks.float().view(1, -1, 1).expand(query.shape[0], -1, 1))
    combined = torch.cat(logits, dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1).to(keys.dtype)
    out = torch.einsum("nhk,kd->nhd", probs[..., : keys.shape[0]], keys)
    if picked is not None:
        out += torch.einsum("nhp,npd->nhd", probs[..., keys.shape[0] : -1], picked[0])
    return out


def attend_window_and_entries(
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
    """``V4AttentionBackend.forward_v4`` in plain torch (see there), one sequence at a time:
    its window's keys and its closed entries gathered densely, a mask saying which each
    query attends, then ``attend_with_sinks``, then the de-rotation if asked for. What the
    reference backend runs, and what a V4 layer runs on a backend without the capability."""
    if entry_indices is not None:
        if compress_rate is None:
            raise ValueError("entry_indices name compressed entries, but compress_rate is None")
        metadata.check_sparse_indices(entry_indices, compress_rate)
    windowed, full = metadata.for_window(window), metadata.for_window(None)
    out = torch.zeros_like(query)
    for seq, seq_len in enumerate(metadata.seq_lens_host):
        start, end = metadata.query_start_loc_host[seq], metadata.query_start_loc_host[seq + 1]
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        lo = max(0, seq_len - (end - start) - window + 1)
        keys = read_entries(kv_cache["kv"], windowed.block_tables[seq], lo, seq_len)
        key_positions = torch.arange(lo, seq_len, device=query.device)
        allowed = (key_positions[None, :] <= query_positions[:, None]) & (
            key_positions[None, :] > query_positions[:, None] - window
        )
        if compress_rate is not None:
            count = seq_len // compress_rate
            entries = read_entries(kv_cache["compressed"], full.block_tables[seq], 0, count)
            if entry_indices is None:  # HCA: every closed window
                closed = (query_positions + 1) // compress_rate
                chosen = torch.arange(count, device=query.device)[None, :] < closed[:, None]
            else:  # CSA: the listed entries
                picks = entry_indices[start:end].to(device=query.device, dtype=torch.long)
                if picks.shape[1] < count:
                    # Fewer picks than entries (a long context): each query gathers its own,
                    # so the work grows with the picks, not with the context.
                    picked = (entries[picks.clamp(min=0)], picks >= 0)
                    out[start:end] = attend_with_sinks(query[start:end], keys, allowed, sinks, layer.scale, picked)
                    continue
                chosen = torch.zeros(end - start, count + 1, dtype=torch.bool, device=query.device)
                chosen.scatter_(1, picks.masked_fill(picks < 0, count), True)  # -1 lands in a spare column
                chosen = chosen[:, :count]
            keys = torch.cat((keys, entries))
            allowed = torch.cat((allowed, chosen), dim=1)
        out[start:end] = attend_with_sinks(query[start:end], keys, allowed, sinks, layer.scale)
    if derotate is not None:
        cos, sin = derotate
        out = rotate_trailing(out, cos.unsqueeze(1), -sin.unsqueeze(1))
    return out


class GroupedLinear(nn.Module):
    """The grouped low-rank output projection's first half: the input ``[n, heads * d]`` is
    cut into ``groups`` equal slices and slice ``i`` goes through rows ``i*r:(i+1)*r`` of
    ``weight`` ``[groups * r, heads * d / groups]`` (block-diagonal); ``[n, groups * r]``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        grouped = x.view(n, self.groups, -1).transpose(0, 1)  # [g, n, in]
        w = self.weight.view(self.groups, -1, self.weight.shape[-1]).transpose(1, 2)  # [g, in, r]
        return torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1)


__all__: Sequence[str] = [
    "CompressedIndexer",
    "Compressor",
    "GroupedLinear",
    "V4RMSNorm",
    "attend_with_sinks",
    "rotate_trailing",
    "unweighted_rms_norm",
]
