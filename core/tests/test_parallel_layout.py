"""Who holds requests and which experts: the layout rules and their error messages."""

from __future__ import annotations

import pytest

from powertrain.parallel.layout import ParallelLayout, ParallelLayoutError, RankPlacement


@pytest.mark.parametrize(
    ("dp", "ep", "world", "attention"),
    [
        (1, 1, 1, (0,)),
        (2, 1, 2, (0, 1)),
        (2, 2, 2, (0, 1)),
        (1, 4, 4, (0,)),
        (2, 4, 4, (0, 2)),
        (4, 4, 4, (0, 1, 2, 3)),
    ],
)
def test_world_and_attention_ranks(dp: int, ep: int, world: int, attention: tuple[int, ...]) -> None:
    layout = ParallelLayout(dp, ep)
    assert layout.world_size == world
    assert layout.attention_ranks == attention
    assert [layout.is_attention_rank(r) for r in range(world)] == [r in attention for r in range(world)]


def test_experts_are_split_evenly_and_cover_every_expert() -> None:
    layout = ParallelLayout(1, 4)
    slices = [layout.expert_slice(rank, 16) for rank in range(4)]
    assert slices == [(0, 4), (4, 4), (8, 4), (12, 4)]
    assert ParallelLayout(2, 1).expert_slice(1, 16) == (0, 16)  # no expert parallelism: all local


def test_expert_parallel_must_be_a_multiple_of_data_parallel() -> None:
    with pytest.raises(ParallelLayoutError, match=r"data_parallel=4, expert_parallel=2.*multiple of data_parallel"):
        ParallelLayout(4, 2)
    with pytest.raises(ParallelLayoutError, match=r"both must be >= 1"):
        ParallelLayout(0, 1)


def test_experts_that_do_not_split_are_refused_with_the_count() -> None:
    with pytest.raises(ParallelLayoutError, match=r"8 routed experts, which expert_parallel=3 does not divide"):
        ParallelLayout(1, 3).expert_slice(0, 8)


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ParallelLayoutError, match=r"rank 4 is outside the world of 4 processes"):
        RankPlacement(layout=ParallelLayout(2, 4), rank=4)
    assert RankPlacement(layout=ParallelLayout(2, 4), rank=2).holds_requests
    assert not RankPlacement(layout=ParallelLayout(2, 4), rank=3).holds_requests


def test_the_model_and_the_layout_read_one_expert_split() -> None:
    """A model slices its experts from its ModelContext (models do not know the parallel
    layout); the dispatcher's layout must agree with it rank by rank."""
    import torch

    from powertrain.interfaces.model import ModelContext

    layout = ParallelLayout(data_parallel=2, expert_parallel=4)
    for rank in range(4):
        context = ModelContext(
            config={},
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=None,
            expert_parallel_rank=rank,
            expert_parallel_size=4,
        )
        assert context.local_experts(16) == layout.expert_slice(rank, 16) == (4 * rank, 4)
    with pytest.raises(ValueError, match="18 routed experts, which expert_parallel=4 does not divide"):
        context.local_experts(18)
