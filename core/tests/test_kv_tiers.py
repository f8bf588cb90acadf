"""The block manager with tiers below its pools, over a real cache: evicted blocks are
copied out before anything overwrites them, a later lookup loads them into fresh blocks
bit for bit, in every retention class, and a block a tier cannot produce shortens the
hit instead of being loaded."""

from __future__ import annotations

import random
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from powertrain.builtin.directory_store import DirectoryStore
from powertrain.engine.block_manager import BlockManager, tier_key
from powertrain.engine.host_store import HostMemoryStore
from powertrain.engine.kv_tiers import KVTiers
from powertrain.engine.kv_transfer import BlockMover
from powertrain.engine.sequence import Request, Sequence
from powertrain.interfaces import AttentionLayerSpec, CacheGroupSpec, KVCacheSpec, KVTensorSpec
from powertrain.interfaces.sampling import SamplingParams

BLOCK = 4
WINDOW = 6
#: A full-history GQA layer with an indexer-like group of its own, and a sliding one.
LAYERS = [
    AttentionLayerSpec(
        kind="gqa",
        num_heads=2,
        num_kv_heads=1,
        head_size=8,
        scale=1.0,
        cache_groups=(CacheGroupSpec(name="index", tensors=(KVTensorSpec(name="index_keys", shape=(3,)),)),),
    ),
    AttentionLayerSpec(kind="gqa", num_heads=2, num_kv_heads=1, head_size=8, scale=1.0, sliding_window=WINDOW),
]


def seq_of(tokens: list[int]) -> Sequence:
    return Request(f"r{random.random()}", None, tokens, SamplingParams()).sequences[0]


class Harness:
    """A block manager, a random cache and a mover, as the engine wires them."""

    def __init__(self, tiers: KVTiers, num_blocks: dict[int | None, int], namespace: bytes = b"tiny") -> None:
        self.caches = []
        for layer in LAYERS:
            cache = layer.allocate_cache(KVCacheSpec.standard(layer, BLOCK, torch.float32), num_blocks, "cpu")
            for tensor in cache.values():
                tensor.copy_(torch.randn(tensor.shape))
            self.caches.append(cache)
        self.mover = BlockMover(zip(LAYERS, self.caches, strict=True), tiers, torch.device("cpu"))
        self.manager = BlockManager(
            num_blocks, BLOCK, namespace=namespace, tiers=tiers, block_bytes=self.mover.block_bytes
        )

    def run(self, seq: Sequence) -> None:
        """Admit ``seq`` whole, copy as the engine would before its step, "compute" it
        (fresh random values in the blocks it computes) and publish it."""
        matched = self.manager.match_prefix(seq)
        assert self.manager.can_allocate(seq, seq.num_tokens, matched)
        self.manager.allocate(seq, seq.num_tokens, matched)
        transfers = self.manager.take_transfers()
        if transfers is not None:
            self.mover.run(transfers)
        for window, table in seq.block_tables.items():
            for index, block_id in enumerate(table):
                if index * BLOCK >= seq.num_computed_tokens and block_id < self.manager.pools[window].null_block:
                    self.write_random(window, block_id)
        seq.num_computed_tokens = seq.num_tokens
        self.manager.register_computed(seq)

    def write_random(self, window: int | None, block_id: int) -> None:
        for tensor in self.mover.tensors[window]:
            tensor[block_id] = torch.randn(tensor[block_id].shape)

    def block(self, window: int | None, block_id: int) -> list[torch.Tensor]:
        return [tensor[block_id].clone() for tensor in self.mover.tensors[window]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_evicted_blocks_come_back_bit_for_bit_in_every_class(seed: int) -> None:
    tiers = KVTiers([("host", HostMemoryStore(None))])
    harness = Harness(tiers, {None: 6, WINDOW: 6})
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(17)]  # 4 full blocks and a token
    first = seq_of(prompt)
    harness.run(first)
    kept = {w: [harness.block(w, b) for b in table] for w, table in first.block_tables.items()}
    harness.manager.free_sequence(first)
    # Another request takes every block: the cached ones are copied out first.
    other = seq_of([rng.randrange(1000, 2000) for _ in range(22)])
    harness.run(other)
    tiers.flush()
    assert all(
        not pool.cached or all(b in other.block_table for b in pool.cached.values())
        for pool in harness.manager.pools.values()
    )
    harness.manager.free_sequence(other)
    again = seq_of(prompt + [7, 7, 7])
    matched = harness.manager.match_prefix(again)
    assert matched.num_tokens == 16 and matched.tier_tokens == {"host": 16}, f"seed={seed}"
    # The sliding class needs only the blocks the window at token 16 reads: blocks 2 and 3.
    assert sorted(i for w, i in matched.loads if w == WINDOW) == [2, 3]
    harness.run(again)
    for w, table in again.block_tables.items():
        for index in range(4):
            if w is None or index >= 2:
                assert same(harness.block(w, table[index]), kept[w][index]), f"class {w} block {index} (seed={seed})"
    assert harness.manager.stats.tier_hit_tokens == {"host": 16}
    # Evicted again, the loaded blocks are not copied out a second time: the tiers hold them.
    loaded = {(w, b) for w, table in again.block_tables.items() for b in table[:4]}
    harness.manager.free_sequence(again)
    last = seq_of([rng.randrange(2000, 3000) for _ in range(22)])  # takes every block
    harness.manager.allocate(last, last.num_tokens, harness.manager.match_prefix(last))
    copied = harness.manager.take_transfers()
    assert copied is not None and copied.offloads, "the block computed after the hit is copied out"
    assert not loaded & {(w, b) for w, b, _ in copied.offloads}, f"seed={seed}"
    tiers.close()


def test_a_block_the_tier_cannot_produce_shortens_the_hit(tmp_path: Path, seed: int) -> None:
    store = DirectoryStore(tmp_path, None)
    tiers = KVTiers([("directory", store)])
    harness = Harness(tiers, {None: 5, WINDOW: 5})
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(17)]
    first = seq_of(prompt)
    harness.run(first)
    harness.manager.free_sequence(first)
    harness.run(seq_of([rng.randrange(1000, 2000) for _ in range(18)]))
    tiers.flush()
    hashes = first.block_hashes
    # Block 2 of the full class is damaged: only blocks 0 and 1 can come back.
    path = store.file_of(tier_key(hashes[2], None))
    path.write_bytes(path.read_bytes()[:-5])
    matched = harness.manager.match_prefix(seq_of(prompt))
    assert matched.num_tokens == 8, f"seed={seed}"
    tiers.close()


def test_only_the_same_namespace_hits(seed: int) -> None:
    host = HostMemoryStore(None)
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(9)]
    writer = Harness(KVTiers([("host", host)]), {None: 3, WINDOW: 3}, namespace=b"model A")
    first = seq_of(prompt)
    writer.run(first)
    writer.manager.free_sequence(first)
    writer.run(seq_of([rng.randrange(1000, 2000) for _ in range(9)]))  # evicts the prompt's blocks
    writer.mover.tiers.flush()
    for namespace, expected in ((b"model B", 0), (b"model A", 8)):
        reader = Harness(KVTiers([("host", host)]), {None: 3, WINDOW: 3}, namespace=namespace)
        assert reader.manager.match_prefix(seq_of(prompt)).num_tokens == expected, namespace


def test_a_published_prompt_is_another_caches_hit_bit_for_bit(tmp_path: Path, seed: int) -> None:
    """Prefill/decode disaggregation's hand-off: one cache publishes a prompt's blocks to
    the shared tier (not to its own host tier), another loads them."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(17)]  # 4 full blocks and a token
    host = HostMemoryStore(None)
    writer = Harness(KVTiers([("host", host), ("directory", DirectoryStore(tmp_path, None))]), {None: 6, WINDOW: 6})
    first = seq_of(prompt)
    writer.run(first)
    kept = {w: [writer.block(w, b) for b in table] for w, table in first.block_tables.items()}
    writer.manager.free_sequence(first)
    publication = writer.manager.prefix_publication(prompt)
    offloads = publication.offloads
    assert publication.elsewhere == []
    published: Future[int] = Future()
    writer.mover.publish(publication, published)
    # Every block of the full class, and the sliding blocks still cached (all, here).
    assert published.result(timeout=30) == len(offloads) == 8
    assert host.get([key for _, _, key in offloads]) == [None] * 8  # the host tier is this process's own
    again: Future[int] = Future()
    writer.mover.publish(writer.manager.prefix_publication(prompt), again)
    assert again.result(timeout=30) == 0  # the store holds them already
    writer.manager.mark_stored(prompt)  # the engine does, once a publication succeeded
    # Evicted now (another request takes every block), they are not copied out again: the
    # store has them.
    other = seq_of([rng.randrange(1000, 2000) for _ in range(22)])
    writer.manager.allocate(other, other.num_tokens, writer.manager.match_prefix(other))
    taken = {(w, b) for w, table in other.block_tables.items() for b in table}
    assert {(w, b) for w, b, _ in offloads} <= taken
    assert writer.manager.take_transfers() is None

    reader = Harness(KVTiers([("directory", DirectoryStore(tmp_path, None))]), {None: 6, WINDOW: 6})
    seq = seq_of(prompt)
    assert reader.manager.match_prefix(seq).tier_tokens == {"directory": 16}, f"seed={seed}"
    reader.run(seq)
    for w, table in seq.block_tables.items():
        for index in range(4):
            if w is None or index >= 2:  # the sliding class needs the window at token 16 only
                assert same(reader.block(w, table[index]), kept[w][index]), f"class {w} block {index} (seed={seed})"
    writer.mover.tiers.close()
    reader.mover.tiers.close()


def test_a_publication_a_store_refuses_fails_with_the_reason(tmp_path: Path, seed: int) -> None:
    store = DirectoryStore(tmp_path / "store", None)
    harness = Harness(KVTiers([("directory", store)]), {None: 6, WINDOW: 6})
    prompt = [random.Random(seed).randrange(1000) for _ in range(9)]
    first = seq_of(prompt)
    harness.run(first)
    harness.manager.free_sequence(first)
    (tmp_path / "store").rename(tmp_path / "gone")
    (tmp_path / "store").write_bytes(b"a file where the directory was")
    published: Future[int] = Future()
    harness.mover.publish(harness.manager.prefix_publication(prompt), published)
    with pytest.raises(OSError, match="kv store 'directory' failed to take 4 published blocks"):
        published.result(timeout=30)
    # Unmarked (the publication failed), they are copied out when evicted.
    other = seq_of(list(range(1000, 1022)))
    harness.manager.allocate(other, other.num_tokens, harness.manager.match_prefix(other))
    transfers = harness.manager.take_transfers()
    assert transfers is not None and len(transfers.offloads) == 4
    harness.mover.tiers.close()


def test_a_publication_of_blocks_the_cache_no_longer_holds_needs_them_in_a_tier(tmp_path: Path, seed: int) -> None:
    """A prompt whose blocks left the prefill rank's cache before the hand-off (evicted, or
    never cached: its sequence preempted while its last step ran) publishes nothing of its
    own. It succeeds only where the blocks are somewhere: in the shared store already, or
    in this process's host tier (written from there); else it fails with the reason, never
    "0 blocks written" for a hit the decode rank would then miss."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(9)]  # 2 full blocks and a token

    def evicted(harness: Harness) -> dict[int | None, list[list[torch.Tensor]]]:
        first = seq_of(prompt)
        harness.run(first)
        kept = {w: [harness.block(w, b) for b in table] for w, table in first.block_tables.items()}
        harness.manager.free_sequence(first)
        harness.run(seq_of([rng.randrange(1000, 2000) for _ in range(9)]))  # takes every block
        harness.mover.tiers.flush()
        return kept

    def publish(harness: Harness) -> Future[int]:
        publication = harness.manager.prefix_publication(prompt)
        # Nothing cached; a hit of 8 tokens needs both blocks of each class (the window of
        # 6 at token 8 reaches back into the first).
        assert publication.offloads == [] and len(publication.elsewhere) == 4, publication
        published: Future[int] = Future()
        harness.mover.publish(publication, published)
        return published

    # Evicted into the host tier only: published from there, bit for bit.
    host = HostMemoryStore(None)
    writer = Harness(
        KVTiers([("host", host), ("directory", DirectoryStore(tmp_path / "a", None))]), {None: 3, WINDOW: 3}
    )
    kept = evicted(writer)
    assert publish(writer).result(timeout=30) == 4, f"seed={seed}"
    reader = Harness(KVTiers([("directory", DirectoryStore(tmp_path / "a", None))]), {None: 3, WINDOW: 3})
    seq = seq_of(prompt)
    assert reader.manager.match_prefix(seq).tier_tokens == {"directory": 8}, f"seed={seed}"
    reader.run(seq)
    assert same(reader.block(None, seq.block_tables[None][0]), kept[None][0]), f"seed={seed}"
    # Evicted into the shared store itself (no host tier): already there, nothing to write.
    shared = Harness(KVTiers([("directory", DirectoryStore(tmp_path / "b", None))]), {None: 3, WINDOW: 3})
    evicted(shared)
    assert publish(shared).result(timeout=30) == 0, f"seed={seed}"
    # Nowhere (the store dropped them since): the hand-off fails and says why.
    lost = Harness(KVTiers([("directory", DirectoryStore(tmp_path / "c", None))]), {None: 3, WINDOW: 3})
    evicted(lost)
    for path in (tmp_path / "c").rglob("*"):
        if path.is_file():
            path.unlink()
    with pytest.raises(LookupError, match="4 of the prompt's blocks left the cache before they were published"):
        publish(lost).result(timeout=30)
    # And with the store gone, the failure is the store's.
    (tmp_path / "b").rename(tmp_path / "b-gone")
    (tmp_path / "b").write_bytes(b"a file where the directory was")
    with pytest.raises(OSError, match="failed to say whether it holds the prompt's blocks"):
        publish(shared).result(timeout=30)
    for harness in (writer, reader, shared, lost):
        harness.mover.tiers.close()
