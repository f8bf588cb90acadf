"""Block manager: reference counts, prefix cache by hash chain, LRU eviction."""

from __future__ import annotations

import random

import pytest

from powertrain.engine.block_manager import BlockManager
from powertrain.engine.sequence import Request, Sequence
from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.scheduling import PrefixMatch


def seq_of(tokens: list[int]) -> Sequence:
    return Request(f"r{random.random()}", None, tokens, SamplingParams()).sequences[0]


def hits(match: PrefixMatch) -> list[int | None]:
    """The full-history pool's blocks of a prefix match."""
    return list(match.blocks.get(None, ()))


def admit(manager: BlockManager, seq: Sequence) -> list[int | None]:
    matched = manager.match_prefix(seq)
    assert manager.can_allocate(seq, seq.num_tokens, matched)
    manager.allocate(seq, seq.num_tokens, matched)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_computed(seq)
    return hits(matched)


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
    assert manager.num_free_blocks == 10 and all(block.ref_count == 0 for block in manager.primary.blocks)


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
    assert all(manager.primary.blocks[b].ref_count == 2 for b in matched)
    # A prompt that is exactly cached still recomputes its last block (logits are needed).
    same = seq_of(prompt)
    assert hits(manager.match_prefix(same)) == first.block_table[:2]
    assert manager.stats.hit_tokens == 12 and manager.stats.queried_tokens == 14 + 15


def test_divergent_prefix_stops_matching_at_the_first_different_block() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    admit(manager, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(hits(manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 0, 8, 9, 10])))) == 1
    assert hits(manager.match_prefix(seq_of([9, 2, 3, 4, 5, 6, 7, 8, 9]))) == []


def test_freed_cached_blocks_are_reused_until_evicted_lru_tail_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = seq_of([1, 2, 3, 4, 5, 6, 7])  # 4 blocks: [1,2] [3,4] [5,6] [7]
    admit(manager, a)
    head, second, third = a.block_table[:3]
    manager.free_sequence(a)
    # Still cached after freeing:
    assert hits(manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 9]))) == [head, second, third]
    # Taking one fresh block evicts the sequence's last block first, not its head.
    b = seq_of([50, 51])
    admit(manager, b)
    assert hits(manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 9]))) == [head, second, third]
    c = seq_of([60, 61])
    admit(manager, c)  # evicts the tail block [5,6]
    assert hits(manager.match_prefix(seq_of([1, 2, 3, 4, 5, 6, 9]))) == [head, second]


def test_hits_on_free_blocks_take_them_off_the_free_list() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    admit(manager, a)
    manager.free_sequence(a)
    b = seq_of([1, 2, 3, 4, 6])
    matched = manager.match_prefix(b)
    assert len(hits(matched)) == 2 and matched.num_tokens == 4
    assert manager.can_allocate(b, 5, matched)  # 2 cached + 1 fresh = all 3 blocks
    manager.allocate(b, 5, matched)
    assert manager.num_free_blocks == 0
    assert not manager.can_allocate(seq_of([9, 9]), 2, PrefixMatch())


def test_placeholder_tokens_are_never_published() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = seq_of([1, 2, 3])
    admit(manager, seq)
    seq.token_ids.append(-1)  # a token still being sampled
    seq.num_computed_tokens = 4
    manager.append(seq, 4)
    manager.register_computed(seq)
    assert len(hits(manager.match_prefix(seq_of([1, 2, 3, 0, 5])))) == 1


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)


# --------------------------------------------------------------------------- retention classes


def decode(manager: BlockManager, seq: Sequence, token: int) -> None:
    """One decode step as the scheduler and engine run it."""
    seq.token_ids.append(token)
    assert manager.can_append(seq, seq.num_tokens)
    manager.append(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_computed(seq)


@pytest.mark.parametrize("window", [1, 3, 4, 9])
def test_a_long_sequence_holds_a_bounded_number_of_sliding_blocks(window: int) -> None:
    block_size = 4
    manager = BlockManager({None: 64, window: 8}, block_size)
    seq = seq_of([random.randrange(100) for _ in range(6)])
    admit(manager, seq)
    bound = -(-(window - 1) // block_size) + 1
    for _ in range(200 - 6):
        decode(manager, seq, random.randrange(100))
        held = manager.blocks_held(seq)
        assert held[window] <= bound + 1, held  # the window, plus the block the next token opens
        assert held[None] == -(-seq.num_tokens // block_size) or held[None] == 64
        # What the next query reads is still held, and what it cannot read is released.
        sliding = manager.pools[window]
        first = sliding.first_needed(seq.num_computed_tokens)
        table = seq.block_tables[window]
        assert all(b == sliding.null_block for b in table[: max(first - 1, 0)])
        assert sliding.null_block not in table[first:]
        if seq.num_tokens >= 64 * block_size - 1:
            break
    assert len(seq.block_tables[window]) == len(seq.block_tables[None])  # one table length for every class
    manager.free_sequence(seq)
    assert all(pool.num_free == len(pool.blocks) for pool in manager.pools.values())


def test_released_sliding_blocks_go_back_to_the_pool_for_others() -> None:
    manager = BlockManager({4: 4}, block_size=2)  # a sliding-only model: 4 blocks in all
    a = seq_of([1, 2, 3, 4, 5, 6, 7])
    admit(manager, a)  # 4 blocks
    assert manager.num_free_blocks == 0 and manager.max_sequence_tokens is None
    b = seq_of([9, 9])
    assert not manager.can_allocate(b, 2, manager.match_prefix(b))
    decode(manager, a, 8)  # the next query (position 7) reads positions 4..7: blocks 0 and 1 go
    assert manager.blocks_held(a) == {4: 2} and manager.num_free_blocks == 2
    assert manager.can_allocate(b, 2, manager.match_prefix(b))


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_class() -> None:
    window, block_size = 4, 2
    manager = BlockManager({None: 16, window: 6}, block_size)
    prompt = [random.randrange(1000) for _ in range(12)]
    a = seq_of(prompt)
    admit(manager, a)
    decode(manager, a, 5)  # releases sliding blocks 0..3 (positions < 12 - 4 + 1)
    sliding = manager.pools[window]
    b = seq_of(prompt + [7])
    matched = manager.match_prefix(b)
    assert matched.num_tokens == 12
    assert matched.blocks[window][:4] == (None,) * 4 and list(matched.blocks[window][4:]) == a.block_tables[window][4:6]
    assert list(matched.blocks[None]) == a.block_tables[None][:6]
    manager.allocate(b, b.num_tokens, matched)
    assert b.block_tables[window][:4] == [sliding.null_block] * 4 and b.num_computed_tokens == 12
    manager.free_sequence(a)
    manager.free_sequence(b)
    # Take five of the sliding pool's six blocks (LRU first): its copies of the prompt's
    # blocks 0..3 and 5 go, block 4 stays. The full pool still holds the whole prompt, but
    # no hit length finds its window in the sliding pool, so nothing is hit.
    for i in range(5):
        admit(manager, seq_of([2000 + i, 2000 + i]))
    c = seq_of(prompt + [7])
    full = manager.pools[None]
    prompt_hashes = a.block_hashes[:6]
    assert all(h in full.cached for h in prompt_hashes)
    assert [h in sliding.cached for h in prompt_hashes] == [False] * 4 + [True, False]
    assert manager.match_prefix(c).num_tokens == 0


def test_drafts_grow_without_releasing_what_the_step_reads() -> None:
    window, block_size = 4, 2
    manager = BlockManager({window: 16}, block_size)
    seq = seq_of(list(range(10)))
    admit(manager, seq)
    seq.token_ids.append(10)
    manager.append(seq, 11)  # the step's query sits at position 10: reads 7..10
    seq.num_computed_tokens = 11
    seq.token_ids.extend([11, 12, 13])  # drafts verified in the same step
    assert manager.can_grow(seq, 14)
    manager.grow(seq, 14)
    table = seq.block_tables[window]
    assert table[3] != manager.pools[window].null_block  # block 3 (positions 6, 7) still held
    assert len(table) == 7
