"""Conformance checks for the Lightning Indexer (``LightningIndexerBackend``, capability
``lightning-indexer``): one random step against a float64 oracle that knows nothing of paging.

Scores of random inputs are distinct, but float32 and float64 may order two nearly equal
ones differently, so a row is judged by what it picked, not by equality with the oracle's
list: its width and ``-1`` count, distinct visible keys, and the oracle's score of its
``j``-th pick equal (to a tolerance) to the oracle's ``j``-th best score. A wrong key, a
missed visible one, an unsorted row or a future key all fail that.

``AttentionBackendSuite.test_index_topk*`` call this for a declared backend.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from powertrain.interfaces import AttentionMetadata
from powertrain.testing.base import shuffled_block_tables

__all__ = ["check_index_topk"]


def check_index_topk(
    backend: Any,
    *,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
    tokens_per_entry: int = 1,
    num_heads: int = 12,
    head_dim: int = 40,
    topk: int = 9,
    relative_tolerance: float = 1e-3,
    what: str = "Lightning Indexer",
) -> None:
    """Run ``backend.index_topk`` on one random step (``(context_len, query_len)`` per
    sequence, decodes first; keys one per ``tokens_per_entry`` tokens, which must divide
    ``block_size``) and assert every row is the oracle's top-k (see the module doc).
    ``relative_tolerance`` is of the row's largest |score|: the inputs' rounding to ``dtype``
    is the oracle's too, so it covers only the kernel's float32 sums."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [c for c, _ in lengths]
    query_lens = [q for _, q in lengths]
    seq_lens = [c + q for c, q in lengths]
    per_block = block_size // tokens_per_entry
    tables, num_blocks = shuffled_block_tables([math.ceil(s / block_size) for s in seq_lens], gen)
    keys = [torch.randn(s // tokens_per_entry, head_dim, generator=gen).to(dtype) for s in seq_lens]
    cache = torch.randn(num_blocks, per_block, head_dim, generator=gen).to(dtype)  # garbage where unused
    for table, seq_keys in zip(tables, keys, strict=True):
        for key, row in enumerate(seq_keys):
            cache[table[key // per_block], key % per_block] = row
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    weights = torch.randn(num_tokens, num_heads, generator=gen)
    metadata = AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=block_size, device=device
    )
    where = (
        f"{what}: context_lens={context_lens} query_lens={query_lens} topk={topk} "
        f"tokens_per_entry={tokens_per_entry} block_size={block_size} (seed={seed})"
    )
    got = backend.index_topk(
        query.to(device),
        weights.to(device),
        cache.to(device),
        metadata,
        topk=topk,
        tokens_per_entry=tokens_per_entry,
    )
    width = max(1, min(topk, max(seq_lens) // tokens_per_entry))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int32, f"index_topk returned {got!r}: {where}"
    assert got.shape[0] >= num_tokens and got.shape[1] == width, (
        f"index_topk returned shape {tuple(got.shape)}, expected ({num_tokens}, {width}): {where}"
    )
    got = got[:num_tokens].cpu()
    starts = [0, *itertools.accumulate(query_lens)]
    for seq, context in enumerate(context_lens):
        for j in range(query_lens[seq]):
            token, position = starts[seq] + j, context + j
            visible = (position + 1) // tokens_per_entry
            scores = (query[token].double() @ keys[seq][:visible].double().T).clamp(min=0)  # [heads, visible]
            scores = weights[token].double() @ scores
            expected = min(topk, visible)
            row = got[token].tolist()
            picks = row[:expected]
            at = f"query row {token} (position {position}, {visible} visible keys), got {row}: {where}"
            assert row[expected:] == [-1] * (width - expected), f"columns past {expected} must be -1, {at}"
            assert len(set(picks)) == expected and all(0 <= p < visible for p in picks), (
                f"the first {expected} columns must be distinct visible keys, {at}"
            )
            best = scores.sort(descending=True).values[:expected]
            tolerance = relative_tolerance * float(scores.abs().max()) if visible else 0.0
            error = (scores[picks] - best).abs().max().item() if expected else 0.0
            assert error <= tolerance, (
                f"picks score {scores[picks].tolist()} where the best are {best.tolist()} (off by {error:.2e}), {at}"
            )
