"""Who does what: data-parallel attention ranks and each rank's slice of the experts.

``world_size = max(data_parallel, expert_parallel)`` processes. With expert parallelism
(``expert_parallel > 1``) it must be a multiple of ``data_parallel``: every process
holds ``num_experts / expert_parallel`` routed experts, and ``data_parallel`` of them,
spread evenly over the ranks (0, W/DP, 2·W/DP, ...), also hold requests and a full KV
cache. The other ranks serve experts only: they run the MoE layers of every step with
no tokens of their own. Without expert parallelism the data-parallel ranks are
independent engines with every expert, and no collectives run at all.

Prefill/decode disaggregation (``prefill_ranks > 0``, without expert parallelism): the
first ``prefill_ranks`` data-parallel ranks only compute prompts; the others decode.
"""

from __future__ import annotations

from typing import Any

import attrs

from powertrain.interfaces.model import expert_slice


class ParallelLayoutError(ValueError):
    """A data/expert-parallel combination or placement that cannot be served."""


@attrs.frozen
class ParallelLayout:
    data_parallel: int = 1
    expert_parallel: int = 1
    prefill_ranks: int = 0

    def __attrs_post_init__(self) -> None:
        dp, ep = self.data_parallel, self.expert_parallel
        if dp < 1 or ep < 1:
            raise ParallelLayoutError(f"[parallel] data_parallel={dp}, expert_parallel={ep}: both must be >= 1")
        if self.prefill_ranks and not 0 < self.prefill_ranks < dp:
            raise ParallelLayoutError(
                f"[parallel] prefill_ranks={self.prefill_ranks}, data_parallel={dp}: prefill ranks are data-parallel "
                f"ranks and at least one must be left to decode (e.g. data_parallel={self.prefill_ranks + 1})"
            )
        if self.prefill_ranks and ep > 1:
            raise ParallelLayoutError(
                f"[parallel] prefill_ranks={self.prefill_ranks} with expert_parallel={ep}: prefill/decode "
                "disaggregation runs without expert parallelism (every rank steps alone); set expert_parallel = 1"
            )
        if ep > 1 and ep % dp:
            raise ParallelLayoutError(
                f"[parallel] data_parallel={dp}, expert_parallel={ep}: with expert parallelism every "
                "process holds an expert slice, so expert_parallel must be a multiple of data_parallel "
                f"(e.g. expert_parallel={dp * max(ep // dp, 1)} or {dp * (ep // dp + 1)})"
            )

    @property
    def world_size(self) -> int:
        return max(self.data_parallel, self.expert_parallel)

    @property
    def expert_parallel_enabled(self) -> bool:
        return self.expert_parallel > 1

    @property
    def attention_ranks(self) -> tuple[int, ...]:
        """The ranks that hold requests, in data-parallel order."""
        stride = self.world_size // self.data_parallel
        return tuple(range(0, self.world_size, stride))

    @property
    def prefill_only_ranks(self) -> tuple[int, ...]:
        """The data-parallel ranks that only prefill (none without disaggregation)."""
        return self.attention_ranks[: self.prefill_ranks]

    @property
    def decode_ranks(self) -> tuple[int, ...]:
        """The data-parallel ranks that decode (every one without disaggregation)."""
        return self.attention_ranks[self.prefill_ranks :]

    def is_attention_rank(self, rank: int) -> bool:
        return rank in self.attention_ranks

    def expert_slice(self, rank: int, num_experts: int) -> tuple[int, int]:
        """``(first expert, number of experts)`` that ``rank`` loads and serves."""
        try:
            return expert_slice(rank, self.expert_parallel, num_experts)
        except ValueError as exc:
            raise ParallelLayoutError(str(exc)) from None


@attrs.frozen(kw_only=True)
class RankPlacement:
    """One process's place in the layout, and how it joins the process group."""

    layout: ParallelLayout
    rank: int = 0
    #: torch.distributed init method (``env://`` under torchrun, ``file://`` locally).
    init_method: str = "env://"
    #: This process's index on its machine: which accelerator it drives.
    local_rank: int = 0

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.layout.world_size:
            raise ParallelLayoutError(
                f"rank {self.rank} is outside the world of {self.layout.world_size} processes that "
                f"data_parallel={self.layout.data_parallel}, expert_parallel={self.layout.expert_parallel} make"
            )

    @property
    def holds_requests(self) -> bool:
        return self.layout.is_attention_rank(self.rank)


def layout_of(config: Any) -> ParallelLayout:
    """The layout an EngineConfig's ``[parallel]`` section asks for."""
    parallel = config.parallel
    return ParallelLayout(parallel.data_parallel, parallel.expert_parallel, parallel.prefill_ranks)
