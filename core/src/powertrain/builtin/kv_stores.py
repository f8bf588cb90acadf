"""The builtin KV stores, registered like any plugin: ``host-memory`` (the host tier)
and ``directory`` (a storage tier on a local disk or a shared filesystem)."""

from __future__ import annotations

from powertrain import hookimpl
from powertrain.builtin.directory_store import DirectoryStore
from powertrain.components import KVStoreRecord
from powertrain.engine.host_store import HostMemoryStore

POWERTRAIN_HOOK_API = 1


@hookimpl
def powertrain_kv_stores() -> list[KVStoreRecord]:
    return [
        KVStoreRecord(
            name="host-memory",
            factory=HostMemoryStore.build,
            description="this process's memory, least recently used dropped first",
        ),
        KVStoreRecord(
            name="directory",
            factory=DirectoryStore.build,
            description="a file per block under [cache] store_path (local disk or shared filesystem), atomic writes",
        ),
    ]
