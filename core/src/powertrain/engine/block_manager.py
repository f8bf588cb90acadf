"""Paged cache blocks: one pool per retention class, reference counts, prefix caching,
sliding-window release, LRU eviction.

A sequence's tokens are cut into blocks of ``block_size``: block ``i`` covers tokens
``[i*block_size, (i+1)*block_size)`` in every cache group (``interfaces.attention.
CacheGroupSpec``). Groups that keep the whole history share the *full* pool (key None);
each sliding window ``W`` has a pool of its own. A sequence holds one block table per
pool (``Sequence.block_tables``), all of the same length; every call here covers all of
them at once, so allocation, prefix hits, preemption and freeing never split a
sequence's groups.

*Sliding release.* ``append`` runs before the step's tokens count in
``num_computed_tokens``: the step's first query sits at ``c = num_computed_tokens``,
its later queries further on, and rejected drafts never roll back below ``c`` (with a
speculative step in flight, ``c`` counts none of its accepted drafts yet: the device thread's
first query comes at or after it). So a sliding pool's blocks wholly before
``c - W + 1`` are never read again: they go back to the pool (keeping their prefix
hash) and the table points them at the pool's null block, a zeroed block no sequence
owns. A long sequence so holds at most ``ceil((W - 1) / block_size) + 1`` blocks of a
sliding pool beyond the step's own.

*Prefix caching.* A full block whose tokens are computed is registered, in every pool
still holding it, under a hash chained over all tokens up to it; blocks nobody
references go to a free list in LRU order and keep their hash (so stay reusable) until
handed out again. *The hit rule:* a sequence takes a hit of ``P`` blocks only where
every class can reproduce the state it would have after computing those ``P * B``
tokens: each full pool holds all ``P`` blocks, and each sliding pool holds the blocks
covering ``[P*B - W + 1, P*B)``, the window its next query reads. (A compressed group's
entries end on the block boundary, since ``block_size`` is a multiple of its
``tokens_per_entry``.) At least one token is always left to compute: the step must
produce logits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import attrs

from powertrain.engine.sequence import Sequence
from powertrain.interfaces.scheduling import PrefixMatch


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


class BlockPool:
    """The blocks of one retention class (``window`` None: the full history)."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block per pool, got {num_blocks} (window={window})")
        self.window = window
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently used first; cached ones keep their hash.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        #: Where a sliding table points released blocks: one past the pool's own blocks.
        self.null_block = num_blocks if window is not None else -1

    def first_needed(self, position: int) -> int:
        """Index of the first block a query at ``position`` (or later) reads."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.block_size)

    def lookup(self, digest: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(digest)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def register(self, block_id: int, digest: int, tokens: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids = digest, tokens
        # First writer wins; an identical block computed twice stays private.
        self.cached.setdefault(digest, block_id)


class BlockManager:
    """Owns the cache blocks; sequences hold one list of block ids per pool.

    ``num_blocks``: usable blocks per retention class (an int: one full-history pool).
    """

    def __init__(
        self, num_blocks: int | Mapping[int | None, int], block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        counts = num_blocks if isinstance(num_blocks, Mapping) else {None: num_blocks}
        if not counts:
            raise ValueError("the KV cache needs at least one pool")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Full history first: it is the primary pool the engine's totals describe.
        order = sorted(counts, key=lambda w: -1 if w is None else w)
        self.pools = {w: BlockPool(counts[w], block_size, w) for w in order}
        self.stats = PrefixCacheStats()

    @property
    def primary(self) -> BlockPool:
        return next(iter(self.pools.values()))

    @property
    def num_blocks(self) -> int:
        """Usable blocks of the primary pool (the full-history one when there is one)."""
        return len(self.primary.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.primary.free)

    @property
    def max_sequence_tokens(self) -> int | None:
        """Most tokens one sequence can hold; None when every pool slides (a sequence then
        holds a bounded number of blocks however long it grows)."""
        full = [len(pool.blocks) for pool in self.pools.values() if pool.window is None]
        return min(full) * self.block_size if full else None

    def blocks_held(self, seq: Sequence) -> dict[int | None, int]:
        """Blocks ``seq`` holds per pool (released sliding blocks not counted)."""
        return {w: sum(b != pool.null_block for b in seq.block_tables.get(w, ())) for w, pool in self.pools.items()}

    def _table_len(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------------- prefix cache

    @staticmethod
    def _chain(previous: int | None, tokens: tuple[int, ...]) -> int:
        return hash((previous, tokens))

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of ``seq`` every pool can reproduce (see the module
        docstring's hit rule), without taking it."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        usable = (seq.num_tokens - 1) // self.block_size
        hits: dict[int | None, list[int | None]] = {w: [] for w in self.pools}
        previous = None
        for index in range(usable):
            tokens = self._block_tokens(seq, index)
            if any(t < 0 for t in tokens):  # a placeholder: the token is not known yet
                break
            previous = self._chain(previous, tokens)
            found = {w: pool.lookup(previous, tokens) for w, pool in self.pools.items()}
            if any(found[w] is None for w, pool in self.pools.items() if pool.window is None):
                break  # a full pool misses: no longer prefix can hit
            for w, block_id in found.items():
                hits[w].append(block_id)
        for num in range(len(next(iter(hits.values()))), 0, -1):
            first = {w: pool.first_needed(num * self.block_size) for w, pool in self.pools.items()}
            if all(b is not None for w in self.pools for b in hits[w][first[w] : num]):
                blocks = {w: tuple([None] * first[w] + hits[w][first[w] : num]) for w in self.pools}
                return PrefixMatch(num_tokens=num * self.block_size, blocks=blocks)
        return PrefixMatch()

    def can_allocate(self, seq: Sequence, num_tokens: int, matched: PrefixMatch) -> bool:
        """Could ``seq`` (with its ``matched`` prefix) get slots for ``num_tokens``?"""
        hit = matched.num_tokens // self.block_size
        new_blocks = max(0, self._table_len(num_tokens) - hit)
        for w, pool in self.pools.items():
            taken_from_free = sum(
                1 for b in matched.blocks.get(w, ()) if b is not None and pool.blocks[b].ref_count == 0
            )
            if new_blocks + taken_from_free > len(pool.free):
                return False
        return True

    def allocate(self, seq: Sequence, num_tokens: int, matched: PrefixMatch) -> None:
        """Give a sequence with no blocks its prefix hits plus fresh blocks for ``num_tokens``."""
        assert not any(seq.block_tables.values()), "allocate() is for sequences without blocks"
        for w, pool in self.pools.items():
            table = []
            for block_id in matched.blocks.get(w, ()):
                if block_id is None:
                    table.append(pool.null_block)
                else:
                    pool.reference(block_id)
                    table.append(block_id)
            seq.block_tables[w] = table
        seq.num_computed_tokens = matched.num_tokens
        seq.num_cached_tokens = matched.num_tokens
        seq.num_registered_blocks = matched.num_tokens // self.block_size
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += seq.num_computed_tokens
        self.grow(seq, num_tokens)

    # ----------------------------------------------------------------------- growth

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Would ``append(seq, num_tokens)`` find the blocks (after its window release)?"""
        return self._fits(seq, num_tokens, release_at=seq.num_computed_tokens)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Release the sliding blocks no query from ``num_computed_tokens`` on reads, then
        grow ``seq``'s tables to hold its first ``num_tokens`` tokens."""
        if any(pool.window is not None for pool in self.pools.values()):
            # Publish first what is about to be released, so it stays prefix-cacheable. Its
            # step may still be running; whoever hits it runs in a later step, after it.
            self.register_computed(seq)
            self._release_window(seq, seq.num_computed_tokens)
        self.grow(seq, num_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Like ``can_append``, releasing nothing (drafts added to a scheduled step)."""
        return self._fits(seq, num_tokens, release_at=None)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s tables to hold its first ``num_tokens`` tokens, releasing nothing."""
        if not self.can_grow(seq, num_tokens):
            raise RuntimeError(f"no room for {num_tokens} tokens of {seq}; check can_append() first")
        target = self._table_len(num_tokens)
        for w, pool in self.pools.items():
            table = seq.block_tables.setdefault(w, [])
            while len(table) < target:
                table.append(pool.take_free())

    def _fits(self, seq: Sequence, num_tokens: int, release_at: int | None) -> bool:
        target = self._table_len(num_tokens)
        for w, pool in self.pools.items():
            table = seq.block_tables.get(w, [])
            available = len(pool.free)
            if release_at is not None and pool.window is not None:
                stop = min(pool.first_needed(release_at), len(table))
                available += sum(1 for b in table[:stop] if b != pool.null_block and pool.blocks[b].ref_count == 1)
            if target - len(table) > available:
                return False
        return True

    def _release_window(self, seq: Sequence, position: int) -> None:
        for w, pool in self.pools.items():
            if pool.window is None:
                continue
            table = seq.block_tables.get(w, [])
            for index in range(min(pool.first_needed(position), len(table)) - 1, -1, -1):
                if table[index] == pool.null_block:
                    break  # released entries form a prefix of the table
                pool.release(table[index])
                table[index] = pool.null_block

    # ----------------------------------------------------------------------- bookkeeping

    def register_computed(self, seq: Sequence) -> None:
        """Publish ``seq``'s full, computed blocks to the prefix cache (after their step was
        launched: a later step that hits them runs after it)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        hashes = seq.block_hashes
        del hashes[full:]  # never past what is computed now
        while len(hashes) < full:
            tokens = self._block_tokens(seq, len(hashes))
            if any(t < 0 for t in tokens):  # a placeholder: the token is not known yet
                break
            hashes.append(self._chain(hashes[-1] if hashes else None, tokens))
        for index in range(seq.num_registered_blocks, len(hashes)):
            tokens = self._block_tokens(seq, index)
            for w, pool in self.pools.items():
                block_id = seq.block_tables[w][index]
                if block_id != pool.null_block:
                    pool.register(block_id, hashes[index], tokens)
        seq.num_registered_blocks = max(seq.num_registered_blocks, len(hashes))

    def free_sequence(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its last blocks become the first to be evicted."""
        for w, pool in self.pools.items():
            for block_id in reversed(seq.block_tables.get(w, ())):
                if block_id != pool.null_block:
                    pool.release(block_id)
        seq.block_tables = {}
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
