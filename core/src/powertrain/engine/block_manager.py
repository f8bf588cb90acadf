"""Paged KV-cache blocks: allocation, reference counts, prefix caching, LRU eviction.

Every block holds ``block_size`` tokens of every layer's cache. A *full* block whose
keys and values have been computed is registered under a hash chained over all
tokens up to it, so a later sequence with the same prefix maps the same block
instead of recomputing it. Blocks nobody references go to a free list in LRU order;
a free block keeps its hash (and so stays reusable) until it is handed out again.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from powertrain.engine.sequence import Sequence


@attrs.define
class Block:
    block_id: int
    ref_count: int = 0
    #: Hash of (previous block's hash, this block's tokens) once full and computed.
    hash: int | None = None
    #: The tokens hashed, to rule out hash collisions on lookup.
    token_ids: tuple[int, ...] = ()


@attrs.define
class PrefixCacheStats:
    """Prompt tokens looked up in, and served from, the prefix cache."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Owns the cache blocks; sequences hold lists of block ids."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently used first; cached ones keep their hash.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have a slot."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ----------------------------------------------------------------------- prefix cache

    @staticmethod
    def _chain(previous: int | None, tokens: tuple[int, ...]) -> int:
        return hash((previous, tokens))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks, without taking them.

        At least one token is always left to compute: the step must produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        previous = None
        usable = (seq.num_tokens - 1) // self.block_size
        for index in range(usable):
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            digest = self._chain(previous, tokens)
            block_id = self.cached.get(digest)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
            previous = digest
        return matched

    def can_allocate(self, seq: Sequence, num_tokens: int, matched: list[int]) -> bool:
        """Could ``seq`` (with ``matched`` prefix blocks) get slots for ``num_tokens``?"""
        taken_from_free = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        new_blocks = max(0, -(-num_tokens // self.block_size) - len(matched))
        return new_blocks + taken_from_free <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int, matched: list[int]) -> None:
        """Give a sequence with no blocks its prefix hits plus fresh blocks for ``num_tokens``."""
        assert not seq.block_table, "allocate() is for sequences without blocks"
        for block_id in matched:
            self._reference(block_id)
        seq.block_table = list(matched)
        seq.num_computed_tokens = len(matched) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += seq.num_computed_tokens
        self.append(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold its first ``num_tokens`` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free):
            raise RuntimeError(f"{needed} blocks needed, {len(self.free)} free; check can_append() first")
        for _ in range(needed):
            seq.block_table.append(self._take_free())

    def register_computed(self, seq: Sequence) -> None:
        """Publish ``seq``'s full, computed blocks to the prefix cache (after their step ran)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        # Hashed blocks always form a prefix of the table: resume after the last one
        # instead of walking the whole sequence every step.
        first = full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        previous = self.blocks[seq.block_table[first - 1]].hash if first else None
        for index in range(first, full):
            block = self.blocks[seq.block_table[index]]
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            if any(t < 0 for t in tokens):  # a placeholder: the token is not known yet
                return
            block.hash = self._chain(previous, tokens)
            block.token_ids = tokens
            # First writer wins; an identical block computed twice stays private.
            self.cached.setdefault(block.hash, block.block_id)
            previous = block.hash

    def free_sequence(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its last blocks become the first to be evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ----------------------------------------------------------------------- internals

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
