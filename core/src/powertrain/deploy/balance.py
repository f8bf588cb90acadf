"""Which data-parallel rank gets a request: the longest cached prefix, within reason.

Each rank has its own prefix cache, so a prompt that shares a long prefix with one
sent to rank r (a chat's earlier turns, a shared system prompt) is cheapest on r: its
blocks are computed already. The front end cannot see the ranks' caches; it keeps,
per rank, the chain hashes of the full prompt blocks it sent there (the block
manager's notion of a cached block), least recently used first out once the rank's
cache would be full (its device cache and the tiers only it reads, host memory; a
shared store serves every rank alike, so it moves no request). A prompt goes to the
rank with the most leading blocks in that record, among the ranks whose load
(requests in flight) is within ``slack`` of the least loaded one, so that one popular
prefix cannot pile every request onto one rank. Ties go to the less loaded rank, then
the lower one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks: block i's hash covers tokens 0 .. (i+1)·size - 1."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixBalancer:
    def __init__(self, ranks: Sequence[int], block_size: int, capacity_blocks: int, slack: int) -> None:
        if not ranks:
            raise ValueError("the balancer needs at least one data-parallel rank")
        self.ranks = list(ranks)
        self.block_size = block_size
        self.capacity_blocks = max(capacity_blocks, 1)
        self.slack = slack
        self.load = dict.fromkeys(self.ranks, 0)
        self._cached: dict[int, OrderedDict[int, None]] = {rank: OrderedDict() for rank in self.ranks}

    def cached_blocks(self, rank: int, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt that ``rank`` is believed to hold."""
        cached = self._cached[rank]
        count = 0
        for h in hashes:
            if h not in cached:
                break
            count += 1
        return count

    def choose(self, token_ids: Sequence[int]) -> int:
        """The rank for a new request (call ``assign`` once it is sent)."""
        if not self.ranks:
            raise ValueError("no rank is left to choose from")
        hashes = block_hashes(token_ids, self.block_size)
        least = min(self.load.values())
        eligible = [rank for rank in self.ranks if self.load[rank] <= least + self.slack]
        return max(eligible, key=lambda rank: (self.cached_blocks(rank, hashes), -self.load[rank], -rank))

    def assign(self, rank: int, token_ids: Sequence[int]) -> None:
        """Record that ``rank`` now computes (and caches) this prompt."""
        self.load[rank] += 1
        cached = self._cached[rank]
        for h in block_hashes(token_ids, self.block_size):
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)

    def finished(self, rank: int) -> None:
        if rank in self.load:
            self.load[rank] = max(self.load[rank] - 1, 0)

    def remove(self, rank: int) -> None:
        """Stop choosing ``rank`` (it died); the balancer is empty once none is left."""
        if rank in self.load:
            self.ranks.remove(rank)
            del self.load[rank], self._cached[rank]
