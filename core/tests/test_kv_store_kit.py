"""The builtin KV stores through the conformance kit (the same suite a store plugin runs)."""

from __future__ import annotations

from powertrain.builtin.directory_store import DirectoryStore
from powertrain.interfaces import KVStore
from powertrain.testing import KVStoreSuite


class TestDirectoryStore(KVStoreSuite):
    component = "directory"

    def damage(self, store: KVStore, key: bytes) -> None:
        assert isinstance(store, DirectoryStore)
        path = store.file_of(key)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


class TestHostMemoryStore(KVStoreSuite):
    component = "host-memory"
