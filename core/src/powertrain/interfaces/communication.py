"""Collectives over a process group, and expert-parallel token exchange.

A communicator record's factory builds a ``Communicator`` from a ``CommunicatorContext``;
its optional ``dispatcher`` builds an ``ExpertDispatcher`` on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, runtime_checkable

import attrs
import torch

from powertrain.interfaces.platform import PlatformInfo

#: What ``ExpertDispatcher.dispatch`` hands ``combine``: each dispatcher's own record of
#: where rows went (counts, permutations, an op's assist tensors). Only the dispatcher
#: that made it reads it, so the contract keeps it a type parameter, not a record.
Handle = TypeVar("Handle")


@attrs.frozen(kw_only=True)
class CommunicatorContext:
    platform: PlatformInfo
    device: torch.device
    #: Ranks and world size as launched; the communicator joins or creates the group.
    rank: int = 0
    world_size: int = 1
    #: torch.distributed init method (``env://``, ``tcp://host:port``, ``file://...``).
    init_method: str = "env://"


@runtime_checkable
class Communicator(Protocol):
    """Collectives over one process group. Every rank calls every collective, in order.

    Arguments that a rank can check by itself (counts that do not add up, a ``src``
    out of range) raise ValueError *before* any communication, so a bad call fails
    instead of hanging its peers. What only the group knows (that every rank passes
    equally shaped tensors to ``all_gather``, that ``recv_counts`` match what peers
    send) is the caller's guarantee. Results may share memory with inputs (world size
    1 returns the input itself); callers use the returned tensor. Ranks are ranks in
    this communicator's group. Implementations on torch.distributed also expose that
    group as ``group`` (for expert dispatchers whose ops need the process group).
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks (in place where possible); returns the result."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's equally shaped ``tensor`` along dim 0, rank order."""
        ...

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Uneven all-to-all over dim 0: rows ``send_counts[j]`` go to rank ``j``.

        Returns the received rows, grouped by source rank. ``recv_counts`` may be
        omitted; the communicator then exchanges the counts first.
        """
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank (same shape and dtype everywhere)."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...

    def close(self) -> None:
        """Release what this communicator created (a group it joined stays). Idempotent."""
        ...


@runtime_checkable
class ExpertDispatcher(Protocol[Handle]):
    """Expert-parallel token exchange, the shape of ``npu_moe_distribute_dispatch`` /
    ``combine`` and of NCCL all-to-all implementations alike.

    ``dispatch`` sends each (token, expert) pair to the rank owning the expert and
    returns the received hidden states grouped by local expert plus an opaque handle;
    ``combine`` sends expert outputs back and applies the routing weights.
    """

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Handle]:
        """Returns (received rows [R, H] grouped by local expert, tokens per local expert
        [local_experts], per-row quant scales or None, handle) — the inputs of
        ``MoEBackend.forward_grouped`` plus what ``combine`` needs."""
        ...

    def combine(self, expert_output: torch.Tensor, handle: Handle) -> torch.Tensor:
        """Returns the weighted sum per original token, ``[num_tokens, H]``."""
        ...
