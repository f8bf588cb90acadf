"""Conformance suite for KV stores (``interfaces.kv_store``).

Subclass it in your plugin's tests::

    class TestMyStore(KVStoreSuite):
        component = "my-store"                      # the record name

        @pytest.fixture
        def context(self, tmp_path) -> KVStoreContext:  # optional: what the factory gets
            return KVStoreContext(capacity_bytes=None, path=str(tmp_path), config=...)

        def damage(self, store, key) -> None:       # optional: corrupt one stored entry
            ...

The store is built through its record's factory from the real plugin manager. Payloads
are fresh random bytes; every check is bit for bit: what ``get`` returns is exactly what
``put`` was given, or None. With ``damage`` overridden, a damaged entry must read as a
miss; a store declaring itself ``shared`` must show a second instance built from the
same context what the first one put (another process, or the next run, sees it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from powertrain.interfaces.kv_store import KVStore, KVStoreContext, StoredBlock
from powertrain.plugins import Provided
from powertrain.testing.base import ComponentSuite, generator


def random_blocks(
    count: int, gen: torch.Generator, max_bytes: int = 5000, size: int | None = None
) -> list[StoredBlock]:
    """``count`` blocks under random 17-byte keys, of random sizes below ``max_bytes``
    (or all of ``size`` bytes)."""
    blocks = []
    for _ in range(count):
        key = torch.randint(0, 256, (17,), generator=gen, dtype=torch.uint8).numpy().tobytes()
        length = size if size is not None else int(torch.randint(1, max_bytes, (), generator=gen))
        blocks.append((key, torch.randint(0, 256, (length,), generator=gen, dtype=torch.uint8)))
    return blocks


class KVStoreSuite(ComponentSuite):
    kind: ClassVar[str] = "kv_store"

    @pytest.fixture
    def context(self, tmp_path: Path) -> KVStoreContext:
        return KVStoreContext(capacity_bytes=None, path=str(tmp_path / "store"))

    @pytest.fixture
    def store(self, provided: Provided, context: KVStoreContext) -> Iterator[KVStore]:
        store = provided.record.factory(context)
        try:
            yield store
        finally:
            store.close()

    def damage(self, store: KVStore, key: bytes) -> None:
        """Corrupt the entry under ``key`` (override where the suite can reach it)."""
        # Where entries are bytes only the store itself reaches (process memory), there is
        # nothing a test could damage that a real fault would: the check does not apply.
        pytest.skip(f"{self.component}: the suite cannot damage its entries (override damage())")

    def test_satisfies_the_protocol(self, store: KVStore) -> None:
        assert isinstance(store, KVStore)
        assert isinstance(store.shared, bool)

    def test_payloads_come_back_bit_for_bit(self, store: KVStore, seed: int) -> None:
        blocks = random_blocks(12, generator(seed))
        store.put(blocks)
        keys = [key for key, _ in blocks]
        absent = b"never put" + keys[0]
        assert store.contains([absent, *keys]) == [False] + [True] * 12, f"seed={seed}"
        got = store.get([keys[3], absent, *keys])
        assert got[1] is None
        for payload, (_, expected) in zip([got[0], *got[2:]], [blocks[3], *blocks], strict=True):
            assert payload is not None and payload.dtype == torch.uint8
            assert torch.equal(payload.cpu(), expected), f"a payload changed (seed={seed})"

    def test_a_held_key_keeps_its_payload(self, store: KVStore, seed: int) -> None:
        gen = generator(seed)
        [(key, first)], [(_, second)] = random_blocks(1, gen), random_blocks(1, gen)
        store.put([(key, first)])
        store.put([(key, second)])
        [payload] = store.get([key])
        assert payload is not None and torch.equal(payload.cpu(), first), f"seed={seed}"

    def test_evicted_keys_are_gone(self, store: KVStore, seed: int) -> None:
        blocks = random_blocks(6, generator(seed))
        store.put(blocks)
        keys = [key for key, _ in blocks]
        store.evict([keys[1], keys[4], b"never put"])
        assert store.contains(keys) == [True, False, True, True, False, True]
        assert store.get([keys[1]]) == [None]

    def test_a_damaged_entry_is_a_miss(self, store: KVStore, seed: int) -> None:
        blocks = random_blocks(3, generator(seed))
        store.put(blocks)
        self.damage(store, blocks[1][0])
        got = store.get([key for key, _ in blocks])
        assert got[1] is None, f"a damaged entry was returned (seed={seed})"
        assert got[0] is not None and torch.equal(got[0].cpu(), blocks[0][1])

    def test_a_shared_store_shows_another_instance_what_was_put(
        self, store: KVStore, provided: Provided, context: KVStoreContext, seed: int
    ) -> None:
        if not store.shared:
            # A store that says it is private promises nobody else sees its blocks.
            pytest.skip(f"{self.component} is not shared")
        blocks = random_blocks(4, generator(seed))
        store.put(blocks)
        other = provided.record.factory(context)
        try:
            got = other.get([key for key, _ in blocks])
            assert all(p is not None and torch.equal(p.cpu(), b) for p, (_, b) in zip(got, blocks, strict=True))
        finally:
            other.close()
