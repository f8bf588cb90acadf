"""The front end's choice of data-parallel rank: cached prefix first, within a load slack."""

from __future__ import annotations

import random

from powertrain.deploy.balance import PrefixBalancer, block_hashes


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(length)]


def test_block_hashes_chain_whole_blocks_only() -> None:
    rng = random.Random(0)
    tokens = prompt(rng, 37)
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # the 5-token tail is no cached block
    changed = [*tokens[:20], tokens[20] + 1, *tokens[21:]]
    assert block_hashes(changed, 16)[0] == hashes[0]  # the first block is untouched
    assert block_hashes(changed, 16)[1] != hashes[1]  # a change inside block 1 changes its chain hash


def test_a_shared_prefix_goes_back_to_the_rank_that_cached_it() -> None:
    rng = random.Random(1)
    balancer = PrefixBalancer([0, 2], block_size=4, capacity_blocks=100, slack=8)
    system = prompt(rng, 32)
    first = balancer.choose(system + prompt(rng, 5))
    assert first == 0  # nothing cached anywhere: the less loaded, then the lower rank
    balancer.assign(first, system + prompt(rng, 5))
    other = prompt(rng, 40)
    assert balancer.choose(other) == 2  # no shared prefix: the less loaded rank
    balancer.assign(2, other)
    for _ in range(3):  # a chat continuing the same system prompt follows its cache
        follow_up = system + prompt(rng, 9)
        assert balancer.choose(follow_up) == 0
        balancer.assign(0, follow_up)


def test_load_slack_stops_one_prefix_from_taking_every_request() -> None:
    rng = random.Random(2)
    balancer = PrefixBalancer([0, 1], block_size=4, capacity_blocks=100, slack=2)
    shared = prompt(rng, 16)
    chosen = []
    for _ in range(8):
        rank = balancer.choose(shared)
        balancer.assign(rank, shared)
        chosen.append(rank)
    assert max(balancer.load.values()) - min(balancer.load.values()) <= 3
    assert chosen[:4] == [0, 0, 0, 1]  # the prefix wins until rank 0 is 3 (> slack) ahead
    for _ in range(5):
        balancer.finished(0)
    assert balancer.choose(shared) == 0


def test_forgotten_blocks_are_the_least_recently_sent() -> None:
    rng = random.Random(3)
    balancer = PrefixBalancer([0, 1], block_size=4, capacity_blocks=4, slack=100)
    old, new = prompt(rng, 16), prompt(rng, 16)
    balancer.assign(0, old)
    balancer.assign(0, new)  # 8 blocks sent, 4 fit: the old prompt's are gone
    assert balancer.cached_blocks(0, block_hashes(new, 4)) == 4
    assert balancer.cached_blocks(0, block_hashes(old, 4)) == 0
