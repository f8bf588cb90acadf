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

*Hashes.* A block's hash is a BLAKE2b digest chained over every token up to its end and
rooted in the cache's ``namespace`` (the model, dtype, cache tensors and block size), so
it names the block's content across processes and restarts, which the tiers need. A block
holding image positions (which all carry one token id) also hashes the digests of those
images' pixels (``engine.images``).

*Tiers* (``engine.kv_tiers``, optional). A cached block evicted from a pool (handed out
again) is first copied out, keyed by its hash and retention class, to the tiers below
(unless it was loaded from them);
a lookup that misses a pool asks the tiers, and a hit there is loaded into a fresh block
before the step that reads it. Copies run on the device thread ahead of the step
(``take_transfers``: the engine submits them before the step it scheduled), so a block
is copied out before anything overwrites it and loaded before anything reads it. A
block a tier cannot produce (gone, corrupt) shortens the hit; it is never loaded.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping

import attrs
import structlog
import torch

from powertrain.engine.images import PromptImage, image_salt
from powertrain.engine.kv_tiers import KVTiers
from powertrain.engine.sequence import Sequence
from powertrain.interfaces.scheduling import PrefixMatch

log = structlog.get_logger(__name__)

Window = int | None


def chain_hash(previous: bytes, tokens: tuple[int, ...], images: bytes = b"") -> bytes:
    """The hash of a block of ``tokens`` after the block hashed ``previous``; ``images``: the
    digests of the images the block holds (``engine.images.image_salt``), empty for text."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes() + images, digest_size=16).digest()


def root_hash(namespace: bytes) -> bytes:
    """What the first block's hash chains from: the cache's compatibility key."""
    return hashlib.blake2b(b"powertrain-kv-1" + namespace, digest_size=16).digest()


def tier_key(block_hash: bytes, window: Window) -> bytes:
    """A block's key in the tiers: its hash and its retention class."""
    return block_hash + (b"F" if window is None else b"W" + window.to_bytes(4, "little"))


@attrs.frozen
class BlockTransfers:
    """Copies to run on the device thread before the next step: blocks to copy out to the
    tiers (retention class, block id, tier key), then payloads to load into blocks."""

    offloads: list[tuple[Window, int, bytes]]
    loads: list[tuple[Window, int, torch.Tensor]]


@attrs.frozen
class Publication:
    """What publishing a prompt takes: copies of the blocks the pools cache (retention
    class, block id, tier key), and the tier keys of the blocks a hit needs that the
    pools no longer hold (evicted, or never cached: a sequence preempted while its last
    step ran), which the store must have already."""

    offloads: list[tuple[Window, int, bytes]]
    elsewhere: list[bytes]


@attrs.define
class Block:
    block_id: int
    ref_count: int = 0
    #: ``chain_hash`` of (previous block's hash, this block's tokens) once full and computed.
    hash: bytes | None = None
    #: The tokens hashed, to rule out hash collisions on lookup.
    token_ids: tuple[int, ...] = ()
    #: Loaded from the tiers, which hold it still: nothing to copy out when it is evicted.
    from_tiers: bool = False


@attrs.define
class PrefixCacheStats:
    """Prompt tokens looked up in, and served from, the prefix cache (``hit_tokens``, of
    which ``tier_hit_tokens[name]`` were loaded back from tier ``name``)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = attrs.field(factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockRecords:
    """A pool's block records, each made when first used: a small model in a large memory
    budget has millions of blocks (tiny DeepSeek-V4 in 4 GiB: 4.8 million), and making
    them all took 6 s of its start."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._count:
                raise IndexError(f"block {block_id} is outside a pool of {self._count}")
            block = self._made[block_id] = Block(block_id)
        return block


class BlockPool:
    """The blocks of one retention class (``window`` None: the full history)."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block per pool, got {num_blocks} (window={window})")
        self.window = window
        self.block_size = block_size
        self.blocks = BlockRecords(num_blocks)
        # Unreferenced blocks least recently used first: those never handed out (ids from
        # ``_fresh`` on, in order), then those released since (cached ones keep their hash).
        self._fresh = 0
        self.free: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}  # hash -> block id
        #: Where a sliding table points released blocks: one past the pool's own blocks.
        self.null_block = num_blocks if window is not None else -1
        #: Blocks taken for good (``reserve``): no sequence can hold them.
        self.reserved = 0
        #: With tiers: cached blocks handed out again, (block id, hash), to copy out first.
        self.evicted: list[tuple[int, bytes]] | None = None

    def first_needed(self, position: int) -> int:
        """Index of the first block a query at ``position`` (or later) reads."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.block_size)

    def lookup(self, digest: bytes, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(digest)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    @property
    def num_free(self) -> int:
        """Blocks no sequence references (cached or not)."""
        return len(self.blocks) - self._fresh + len(self.free)

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
        if self._fresh < len(self.blocks):
            block_id, self._fresh = self._fresh, self._fresh + 1
        else:
            block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.evicted is not None and not block.from_tiers:
                    self.evicted.append((block_id, block.hash))
            block.hash, block.token_ids, block.from_tiers = None, (), False
        block.ref_count = 1
        return block_id

    def reserve(self) -> int:
        """A block taken for good (``BlockManager.reserve_blocks``)."""
        self.reserved += 1
        return self.take_free()

    def register(self, block_id: int, digest: bytes, tokens: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids = digest, tokens
        # First writer wins; an identical block computed twice stays private.
        self.cached.setdefault(digest, block_id)


class BlockManager:
    """Owns the cache blocks; sequences hold one list of block ids per pool.

    ``num_blocks``: usable blocks per retention class (an int: one full-history pool).
    ``namespace``: what makes two caches' blocks interchangeable (the root of the hashes).
    ``tiers``: stores below the pools; ``block_bytes[w]``: a block of class ``w``'s payload
    size there (a payload of another size is a miss).
    """

    def __init__(
        self,
        num_blocks: int | Mapping[int | None, int],
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        namespace: bytes = b"",
        tiers: KVTiers | None = None,
        block_bytes: Mapping[Window, int] | None = None,
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
        self.root = root_hash(namespace)
        self.tiers = tiers if enable_prefix_caching else None
        self.block_bytes = dict(block_bytes or {})
        self._loads: list[tuple[Window, int, torch.Tensor]] = []
        if self.tiers is not None:
            if set(self.block_bytes) != set(self.pools):
                raise ValueError(f"tiers need every class's payload size {list(self.pools)}, got {self.block_bytes}")
            for pool in self.pools.values():
                pool.evicted = []
            self.stats.tier_hit_tokens = dict.fromkeys(self.tiers.names, 0)

    @property
    def primary(self) -> BlockPool:
        return next(iter(self.pools.values()))

    def reserve_blocks(self) -> dict[int | None, int]:
        """Take one block from each pool for good (no sequence will hold it) and return
        their ids: captured decode steps point their padding rows there
        (``engine.cuda_graphs``), whose writes must land where nobody reads."""
        return {window: pool.reserve() for window, pool in self.pools.items()}

    @property
    def num_blocks(self) -> int:
        """Usable blocks of the primary pool (the full-history one when there is one)."""
        return len(self.primary.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.primary.num_free

    @property
    def max_sequence_tokens(self) -> int | None:
        """Most tokens one sequence can hold; None when every pool slides (a sequence then
        holds a bounded number of blocks however long it grows)."""
        full = [len(pool.blocks) - pool.reserved for pool in self.pools.values() if pool.window is None]
        return min(full) * self.block_size if full else None

    def blocks_held(self, seq: Sequence) -> dict[int | None, int]:
        """Blocks ``seq`` holds per pool (released sliding blocks not counted)."""
        return {w: sum(b != pool.null_block for b in seq.block_tables.get(w, ())) for w, pool in self.pools.items()}

    def _table_len(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------------- prefix cache

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of ``seq`` every pool can reproduce (see the module
        docstring's hit rule), from the pools or the tiers, without taking it."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        found: dict[Window, list[int | None]] = {w: [] for w in self.pools}
        hashes: list[bytes] = []
        # A full pool needs every block of a hit: one its pool misses is fetched right away.
        fetched: dict[tuple[Window, int], tuple[str, torch.Tensor]] = {}
        for index, (tokens, previous) in enumerate(self._hit_chain(seq.token_ids, seq.images)):
            here = {w: pool.lookup(previous, tokens) for w, pool in self.pools.items()}
            full_misses = [w for w, pool in self.pools.items() if pool.window is None and here[w] is None]
            if full_misses and self.tiers is None:
                break  # a full pool misses: no longer prefix can hit
            got = {w: self._fetch(previous, w) for w in full_misses}
            if None in got.values():
                break  # a full pool misses everywhere
            fetched.update({(w, index): block for w, block in got.items() if block is not None})
            hashes.append(previous)
            for w, block_id in here.items():
                found[w].append(block_id)
        return self._longest_hit(found, hashes, fetched)

    def _hit_chain(
        self, token_ids: list[int], images: tuple[PromptImage, ...] = ()
    ) -> Iterator[tuple[tuple[int, ...], bytes]]:
        """(tokens, hash) of each block a prompt of ``token_ids`` (holding ``images``) could
        hit, in order: its full blocks but the last token's, up to a placeholder (a token not
        known yet)."""
        previous = self.root
        size = self.block_size
        for index in range((len(token_ids) - 1) // size):
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            if any(t < 0 for t in tokens):
                return
            previous = chain_hash(previous, tokens, image_salt(images, index * size, (index + 1) * size))
            yield tokens, previous

    def _longest_hit(
        self,
        found: Mapping[Window, list[int | None]],
        hashes: list[bytes],
        fetched: dict[tuple[Window, int], tuple[str, torch.Tensor]],
    ) -> PrefixMatch:
        """The longest prefix whose needed blocks are in the pools (``found``), fetched
        already, or can be fetched from the tiers; fetches those."""
        absent: set[tuple[Window, int]] = set()
        num = len(hashes)
        while num > 0:
            first = {w: pool.first_needed(num * self.block_size) for w, pool in self.pools.items()}
            missing = [(w, i) for w in self.pools for i in range(first[w], num) if found[w][i] is None]
            if missing and (self.tiers is None or absent.intersection(missing)):
                num -= 1
                continue
            for w, i in missing:
                if (w, i) not in fetched:
                    got = self._fetch(hashes[i], w)
                    if got is None:
                        absent.add((w, i))
                        break
                    fetched[w, i] = got
            else:
                return self._prefix_match(num, first, found, hashes, {m: fetched[m] for m in missing})
        return PrefixMatch()

    def _fetch(self, block_hash: bytes, window: Window) -> tuple[str, torch.Tensor] | None:
        assert self.tiers is not None
        got = self.tiers.fetch(tier_key(block_hash, window))
        if got is not None and got[1].numel() != self.block_bytes[window]:
            log.warning(
                "kv tier block of the wrong size: a miss",
                tier=got[0],
                bytes=got[1].numel(),
                expected=self.block_bytes[window],
            )
            return None
        return got

    def _prefix_match(
        self,
        num: int,
        first: Mapping[Window, int],
        found: Mapping[Window, list[int | None]],
        hashes: list[bytes],
        loads: Mapping[tuple[Window, int], tuple[str, torch.Tensor]],
    ) -> PrefixMatch:
        blocks = {w: tuple([None] * first[w] + found[w][first[w] : num]) for w in self.pools}
        primary = next(iter(self.pools))
        tiers: dict[str, int] = {}
        for (w, _), (tier, _) in loads.items():
            if w == primary:
                tiers[tier] = tiers.get(tier, 0) + self.block_size
        return PrefixMatch(
            num_tokens=num * self.block_size,
            blocks=blocks,
            loads={(w, i): (hashes[i], payload) for (w, i), (_, payload) in loads.items()},
            tier_tokens=tiers,
        )

    def can_allocate(self, seq: Sequence, num_tokens: int, matched: PrefixMatch) -> bool:
        """Could ``seq`` (with its ``matched`` prefix) get slots for ``num_tokens``?"""
        hit = matched.num_tokens // self.block_size
        new_blocks = max(0, self._table_len(num_tokens) - hit)
        for w, pool in self.pools.items():
            taken_from_free = sum(
                1 for b in matched.blocks.get(w, ()) if b is not None and pool.blocks[b].ref_count == 0
            )
            loaded = sum(1 for window, _ in matched.loads if window == w)
            if new_blocks + loaded + taken_from_free > pool.num_free:
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
        # Fresh blocks for what the tiers hold, once the pools' hits are referenced (so
        # none of those is handed out): loaded before the step, cached from now on.
        for (w, index), (block_hash, payload) in matched.loads.items():
            pool = self.pools[w]
            block_id = pool.take_free()
            pool.register(block_id, block_hash, self._block_tokens(seq, index))
            pool.blocks[block_id].from_tiers = True
            seq.block_tables[w][index] = block_id
            self._loads.append((w, block_id, payload))
        seq.num_computed_tokens = matched.num_tokens
        seq.num_cached_tokens = matched.num_tokens
        seq.num_registered_blocks = matched.num_tokens // self.block_size
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += seq.num_computed_tokens
            for tier, tokens in matched.tier_tokens.items():
                self.stats.tier_hit_tokens[tier] = self.stats.tier_hit_tokens.get(tier, 0) + tokens
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
            available = pool.num_free
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
            salt = image_salt(seq.images, len(hashes) * self.block_size, (len(hashes) + 1) * self.block_size)
            hashes.append(chain_hash(hashes[-1] if hashes else self.root, tokens, salt))
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

    # ----------------------------------------------------------------------- tiers

    def take_transfers(self) -> BlockTransfers | None:
        """The copies this scheduling pass asked for (run them before its step), or None."""
        if self.tiers is None:
            return None
        offloads = []
        for w, pool in self.pools.items():
            assert pool.evicted is not None
            offloads.extend((w, block_id, tier_key(block_hash, w)) for block_id, block_hash in pool.evicted)
            pool.evicted.clear()
        loads, self._loads = self._loads, []
        return BlockTransfers(offloads, loads) if offloads or loads else None

    def _cached_prefix(self, token_ids: list[int]) -> list[tuple[Window, int, bytes]]:
        """(class, block id, hash) of every block a prompt of ``token_ids`` could hit that
        the pools cache."""
        found = []
        for tokens, block_hash in self._hit_chain(token_ids):
            for w, pool in self.pools.items():
                block_id = pool.lookup(block_hash, tokens)
                if block_id is not None:
                    found.append((w, block_id, block_hash))
        return found

    def prefix_publication(self, token_ids: list[int]) -> Publication:
        """Prefill/decode disaggregation's hand-off of a prompt of ``token_ids``: copies of
        every block it could hit that the pools cache, and the keys of those its full hit
        needs that they do not (nothing without tiers)."""
        if self.tiers is None:
            return Publication([], [])
        chain = list(self._hit_chain(token_ids))
        offloads, elsewhere = [], []
        for w, pool in self.pools.items():
            needed = pool.first_needed(len(chain) * self.block_size)
            for index, (tokens, block_hash) in enumerate(chain):
                block_id = pool.lookup(block_hash, tokens)
                if block_id is not None:
                    offloads.append((w, block_id, tier_key(block_hash, w)))
                elif index >= needed:
                    elsewhere.append(tier_key(block_hash, w))
        return Publication(offloads, elsewhere)

    def mark_stored(self, token_ids: list[int]) -> None:
        """The tiers hold the cached blocks of this prompt (it was published): their
        eviction copies nothing out again."""
        for w, block_id, _ in self._cached_prefix(token_ids):
            self.pools[w].blocks[block_id].from_tiers = True

    def cached_transfers(self) -> BlockTransfers | None:
        """Copies of every block the pools cache, to the tiers (at shutdown: a storage tier
        then serves them after a restart), or None without a tier that outlives us."""
        if self.tiers is None or not self.tiers.shared:
            return None
        offloads = [
            (w, block_id, tier_key(block_hash, w))
            for w, pool in self.pools.items()
            for block_hash, block_id in pool.cached.items()
            if not pool.blocks[block_id].from_tiers
        ]
        return BlockTransfers(offloads, [])
