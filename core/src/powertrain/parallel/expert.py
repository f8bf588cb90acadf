"""The expert-parallel token exchange on any ``Communicator``: ``AllToAllDispatcher``.

Rank ``r`` of ``W`` holds routed experts ``r·E/W .. (r+1)·E/W - 1`` (``layout``).
``dispatch`` sends every (token, expert) pair's hidden state to the rank holding the
expert, with the expert's id alongside, and hands the MoE backend the received rows
grouped by local expert (``MoEBackend.forward_grouped``'s input). ``combine`` sends
the expert outputs back the same way and sums each token's pairs in top-k order,
weighted by the routing weights, so a token's result does not depend on which ranks
computed its experts or in which order they answered.

Dispatch runs three all-to-alls (the row counts, the expert ids, the rows) and
combine one. Every rank calls both in every MoE layer, a rank with no tokens
too (zero rows out; it may still receive rows for its experts).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch

from powertrain.interfaces import Communicator


@attrs.frozen
class DispatchHandle:
    """What ``combine`` needs to send outputs back and sum them per token."""

    num_tokens: int
    top_k: int
    #: Pair order on the sending rank (pairs sorted by expert id = by destination rank).
    order: torch.Tensor
    #: topk_weights flattened, float32, in pair order (token-major, then k).
    weights: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    #: Received order -> grouped-by-local-expert order.
    local_order: torch.Tensor


class AllToAllDispatcher:
    """``interfaces.ExpertDispatcher`` over a communicator's uneven ``all_to_all``."""

    def __init__(self, communicator: Communicator) -> None:
        self.communicator = communicator
        self.rank = communicator.rank
        self.world_size = communicator.world_size
        #: Seconds spent in all-to-alls so far (waiting for peers included): the cost of
        #: expert parallelism that benchmarks/parallel.py reports per step.
        self.exchange_seconds = 0.0

    def _all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self.communicator.all_to_all(tensor, send, recv)
        finally:
            self.exchange_seconds += time.perf_counter() - started

    def local_experts(self, num_experts: int) -> int:
        if num_experts % self.world_size:
            raise ValueError(
                f"expert-parallel dispatch: {num_experts} experts do not split evenly over "
                f"{self.world_size} ranks; choose an expert_parallel that divides {num_experts}"
            )
        return num_experts // self.world_size

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DispatchHandle]:
        local = self.local_experts(num_experts)
        if hidden.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"expert-parallel dispatch: hidden {tuple(hidden.shape)} must be [tokens, hidden] and "
                f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} [tokens, top_k]"
            )
        num_tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(ids, stable=True)  # by expert id, so by destination rank too
        sorted_ids = ids[order]
        # The one host sync dispatch needs; it also shows ids past the last expert
        # (bincount itself refuses negative ones).
        send_counts = torch.bincount(sorted_ids // local, minlength=self.world_size).tolist()
        if len(send_counts) > self.world_size:
            raise ValueError(f"expert-parallel dispatch: expert ids must be in [0, {num_experts})")
        recv_counts = self._exchange_counts(send_counts)
        received_ids = self._all_to_all(sorted_ids.unsqueeze(1), send_counts, recv_counts).squeeze(1)
        rows = hidden[order // top_k]
        received = self._all_to_all(rows, send_counts, recv_counts)
        local_ids = received_ids.to(torch.int64) - self.rank * local
        local_order = torch.argsort(local_ids, stable=True)
        tokens_per_expert = torch.bincount(local_ids, minlength=local).to(torch.int64)
        handle = DispatchHandle(
            num_tokens=num_tokens,
            top_k=top_k,
            order=order,
            weights=topk_weights.reshape(-1).float()[order],
            send_counts=send_counts,
            recv_counts=recv_counts,
            local_order=local_order,
        )
        return received[local_order], tokens_per_expert, None, handle

    def _exchange_counts(self, send_counts: list[int]) -> list[int]:
        """Rows each rank sends here: one row of one count to every rank."""
        ones = [1] * self.world_size
        sent = torch.tensor(send_counts, dtype=torch.int64).unsqueeze(1)
        return [int(c) for c in self._all_to_all(sent, ones, ones).squeeze(1).tolist()]

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        in_received_order = torch.empty_like(expert_output)
        in_received_order[handle.local_order] = expert_output
        back = self._all_to_all(in_received_order, handle.recv_counts, handle.send_counts)
        pairs = torch.empty_like(back)
        pairs[handle.order] = back  # token-major, k-minor again
        weights = torch.empty_like(handle.weights)
        weights[handle.order] = handle.weights
        hidden = back.shape[-1]
        weighted = pairs.float().view(handle.num_tokens, handle.top_k, hidden) * weights.view(-1, handle.top_k, 1)
        return weighted.sum(dim=1).to(expert_output.dtype)


def build_dispatcher(record: Any, communicator: Communicator) -> Any:
    """The communicator record's own dispatcher, or the all-to-all one."""
    factory = getattr(record, "dispatcher", None)
    return factory(communicator) if factory is not None else AllToAllDispatcher(communicator)


@attrs.define
class ExpertParallel:
    """This process's share of expert parallelism: its place, its group and the exchange."""

    placement: Any  # layout.RankPlacement
    communicator: Communicator
    dispatcher: Any  # an interfaces.ExpertDispatcher

    def model_context_fields(self) -> dict[str, Any]:
        """What ``interfaces.ModelContext`` needs to slice and reach the experts."""
        return {
            "communicator": self.communicator,
            "expert_parallel_rank": self.placement.rank,
            "expert_parallel_size": self.placement.layout.expert_parallel,
            "expert_dispatcher": self.dispatcher,
        }
