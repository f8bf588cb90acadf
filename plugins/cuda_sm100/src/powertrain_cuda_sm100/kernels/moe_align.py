"""Sort (token, slot) pairs by local expert and pad each expert's run to BLOCK_M rows.

The grouped GEMMs give each M-block of ``BLOCK_M`` sorted rows to one expert, so
every expert's segment starts on a block boundary. Padding rows hold the sentinel
``num_pairs`` and are masked out by the kernels; pairs routed to another rank's
experts (expert parallelism) are dropped here and never computed.

This is plain torch on the device (a stable ``argsort``, a ``scatter_add_``
histogram, ``cumsum``, ``searchsorted``), not a Triton kernel: it is a few small
launches over ``tokens * top_k`` integers, and none of them waits for the host.
Nothing is read back: the buffers are sized by an upper bound known from shapes
alone, and the real padded length stays on the device (``num_padded``), where the
GEMM programs past it read it and exit.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Alignment:
    """Where each sorted row comes from and which expert each M-block runs."""

    #: int32 ``[capacity]``: flat pair ``token * top_k + slot`` per sorted row; ``num_pairs`` on padding rows.
    sorted_pairs: torch.Tensor
    #: int32 ``[capacity // block_m]``: local expert of each M-block (``local_experts`` past the end).
    block_experts: torch.Tensor
    #: int32 ``[1]``: rows in use, a multiple of ``block_m`` (on the device: reading it would sync).
    num_padded: torch.Tensor
    #: ``tokens * top_k``: the sentinel, and the size of per-pair buffers.
    num_pairs: int
    block_m: int

    @property
    def capacity(self) -> int:
        """Rows the buffers hold: an upper bound of ``num_padded``."""
        return self.sorted_pairs.shape[0]


def padded_capacity(num_pairs: int, local_experts: int, block_m: int) -> int:
    """Most rows padding can produce: every non-empty expert (at most ``min(E, pairs)``)
    wastes fewer than ``block_m`` rows."""
    if num_pairs == 0:
        return 0
    bound = num_pairs + min(local_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, first_expert: int, local_experts: int, block_m: int) -> Alignment:
    """Group the pairs of ``topk_ids`` ``[tokens, top_k]`` (global ids) by local expert.

    Pairs of one expert keep token order (stable sort), so the result, and every sum
    built on it, is the same on every run. Needs ``local_experts >= 1``.
    """
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    capacity = padded_capacity(num_pairs, local_experts, block_m)

    expert = topk_ids.reshape(-1).to(torch.int64) - first_expert
    foreign = (expert < 0) | (expert >= local_experts)
    expert = expert.masked_fill(foreign, local_experts)  # one sentinel group past the local ones
    order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]

    counts = torch.zeros(local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    counts = counts[:local_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts

    # Sorted entry i of expert e lands at padded_start[e] + (i - start[e]); foreign
    # entries all go to one spare slot past the end, cut off below.
    local = sorted_expert < local_experts
    e = sorted_expert.clamp(max=local_experts - 1)
    rank = torch.arange(num_pairs, device=device) - start[e]
    dest = torch.where(local, padded_start[e] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))

    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return Alignment(
        sorted_pairs=sorted_pairs[:capacity],
        block_experts=block_experts,
        num_padded=num_padded,
        num_pairs=num_pairs,
        block_m=block_m,
    )


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """Nothing to compile ahead of time: the alignment is torch ops (see the module docstring)."""
    return []
