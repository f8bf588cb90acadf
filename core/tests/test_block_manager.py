"""Block manager: reference counts, prefix cache by hash chain, LRU eviction."""

from __future__ import annotations

import random

import pytest

from powertrain.engine.block_manager import BlockManager
from powertrain.engine.sequence import Request, Sequence
from powertrain.interfaces.sampling import SamplingParams


def seq_of(tokens: list[int]) -> Sequence:
    return Request(f"r{random.random()}", None, tokens, SamplingParams()).sequences[0]


def admit(manager: BlockManager, seq: Sequence) -> list[int]:
    matched = manager.match_prefix(seq)
    assert manager.can_allocate(seq, seq.num_tokens, matched)
    manager.allocate(seq, seq.num_tokens, matched)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_computed(seq)
    return matched


def test_allocation_and_free_keep_counts_exact() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    a, b = seq_of(list(range(10))), seq_of(list(range(100, 105)))
    admit(manager, a)
    admit(manager, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert manager.num_free_blocks == 5
    assert set(a.block_table).isdisjoint(b.block_table)
    manager.free_sequence(a)
    manager.free_sequence(b)
    assert manager.num_free_blocks == 10 and all(block.ref_count == 0 for block in manager.blocks)


def test_prefix_hits_share_full_blocks_and_leave_a_token_to_compute() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    rng = random.Random()
    prompt = [rng.randrange(1000) for _ in range(12)]
    first = seq_of(prompt + [1, 2])
    admit(manager, first)
    second = seq_of(prompt + [7, 8, 9])
    matched = admit(manager, second)
    assert matched == first.block_table[:3]
    assert second.num_cached_tokens == 12
    assert all(manager.blocks[b].ref_count == 2 for b in matched)
    # A prompt that is exactly cached still recomputes its last block (logits are needed).
    same = seq_of(prompt)
    assert manager.match_prefix(same) == first.block_table[:2]
    assert manager.stats.hit_tokens == 12 and manager.stats.queried_tokens == 14 + 15


def test_divergent_prefix_stops_matching_at_the_first_different_block() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    admit(manager, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 0, 8, 9, 10]))) == 1
    assert manager.match_prefix(seq_of([9, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_freed_cached_blocks_are_reused_until_evicted_lru_tail_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = seq_of([1, 2, 3, 4, 5, 6, 7])  # 4 blocks: [1,2] [3,4] [5,6] [7]
    admit(manager, a)
    head, second, third = a.block_table[:3]
    manager.free_sequence(a)
    # Still cached after freeing:
    assert manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 9])) == [head, second, third]
    # Taking one fresh block evicts the sequence's last block first, not its head.
    b = seq_of([50, 51])
    admit(manager, b)
    assert manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 9])) == [head, second, third]
    c = seq_of([60, 61])
    admit(manager, c)  # evicts the tail block [5,6]
    assert manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 9])) == [head, second]


def test_hits_on_free_blocks_take_them_off_the_free_list() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    admit(manager, a)
    manager.free_sequence(a)
    b = seq_of([1, 2, 3, 4, 6])
    matched = manager.match_prefix(b)
    assert len(matched) == 2
    assert manager.can_allocate(b, 5, matched)  # 2 cached + 1 fresh = all 3 blocks
    manager.allocate(b, 5, matched)
    assert manager.num_free_blocks == 0
    assert not manager.can_allocate(seq_of([9, 9]), 2, [])


def test_placeholder_tokens_are_never_published() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = seq_of([1, 2, 3])
    admit(manager, seq)
    seq.token_ids.append(-1)  # a token still being sampled
    seq.num_computed_tokens = 4
    manager.append(seq, 4)
    manager.register_computed(seq)
    assert len(manager.match_prefix(seq_of([1, 2, 3, 0, 5]))) == 1


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
