"""Reading one sequence's rows back from a paged cache tensor, for the plain-torch paths
(the reference backend, V4's compressors and attention, the indexer) that gather densely."""

from __future__ import annotations

import torch


def read_entries(store: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Entries ``[start, end)`` of one sequence from a paged group tensor
    ``[blocks, entries_per_block, *shape]`` through its block-table row ``table``."""
    per_block = store.shape[1]
    first, last = start // per_block, -(-end // per_block)
    rows = store[table[first:last].long()].reshape(-1, *store.shape[2:])
    return rows[start - first * per_block : end - first * per_block]
