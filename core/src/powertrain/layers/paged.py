"""Reading and writing one sequence's entries of a paged cache tensor by position, for the
plain-torch paths (the reference backend, V4's and V4.1's compressors and attention, the
indexers) that gather densely."""

from __future__ import annotations

import torch


def read_entries(store: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Entries ``[start, end)`` of one sequence from a paged group tensor
    ``[blocks, entries_per_block, *shape]`` through its block-table row ``table``."""
    per_block = store.shape[1]
    first, last = start // per_block, -(-end // per_block)
    rows = store[table[first:last].long()].reshape(-1, *store.shape[2:])
    return rows[start - first * per_block : end - first * per_block]


def entry_slots(tables: torch.Tensor, index: torch.Tensor, per_block: int) -> torch.Tensor:
    """Flat slots of entries ``index`` ``[n, k]`` of ``n`` sequences in a paged group
    tensor of ``per_block`` entries a block, through their block-table rows ``[n, width]``."""
    return tables.long().gather(1, index // per_block) * per_block + index % per_block


def write_entries(store: torch.Tensor, table: torch.Tensor, first: int, values: torch.Tensor) -> None:
    """Entries ``first, first + 1, ...`` of one sequence into a paged group tensor."""
    index = torch.arange(first, first + values.shape[0], device=table.device)
    slots = entry_slots(table[None], index[None], store.shape[1])[0]
    store.view(-1, *store.shape[2:]).index_copy_(0, slots.to(store.device), values.to(store.dtype))
