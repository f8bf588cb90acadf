"""The KV store contract: where cache blocks go below the device cache (a plugin kind).

The engine's prefix cache keeps full blocks on the device while it has room. With tiers
configured (``[cache] host_memory_gib``, ``[components] kv_store``), a block evicted from
the device is written to the host-memory tier and, when that fills, on to a storage tier
(a directory, a shared filesystem, a networked store); a prefix lookup that misses the
device loads blocks back from them instead of recomputing.

A store holds *payloads* under *keys*:

* a key is bytes naming a block's content: a strong hash chained over every token up to
  the block's end, rooted in what makes two caches compatible (the model, its dtype, the
  cache tensors' layout and the block size), plus the block's retention class. A store
  never needs to know what it holds to keep incompatible blocks apart;
* a payload is one block of one retention class (every layer's cache tensors of that
  class, one after the other) as a flat ``torch.uint8`` CPU tensor.

A store must never hand back bytes other than those put under the key: a torn write, a
truncated or corrupt entry is reported as a miss (and logged), never returned. Every
call is batched; a store that fails (its directory removed, its server gone) raises, and
the engine treats the failure as a miss and keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

#: One stored block: its key and its payload.
StoredBlock = tuple[bytes, torch.Tensor]


@runtime_checkable
class KVStore(Protocol):
    """Put, get, test and drop hashed cache blocks."""

    #: Bytes of payload it may hold; None: no limit it enforces.
    capacity_bytes: int | None
    #: Whether other processes (or machines) see what this one puts: a shared store
    #: serves blocks another engine computed, and keeps them across restarts.
    shared: bool

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` it holds now (a later ``get`` may still miss)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """The payloads under ``keys``; None for a miss or an entry that fails its check."""
        ...

    def put(self, blocks: Sequence[StoredBlock]) -> list[StoredBlock]:
        """Store ``blocks`` (a key already held keeps its payload); returns the blocks it
        dropped to make room, which the tier above may hand down to the next tier."""
        ...

    def evict(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` (those it does not hold are ignored)."""
        ...

    def close(self) -> None:
        """Release files, connections and threads; the store is not used after."""
        ...


@attrs.frozen(kw_only=True)
class KVStoreContext:
    """What a store's factory is given."""

    #: Bytes of payload the store may hold (``[cache] host_memory_gib`` for the host
    #: tier, ``store_gib`` for the storage tier); None: unbounded.
    capacity_bytes: int | None
    #: ``[cache] store_path``: where a store that keeps files keeps them ("" if unset).
    path: str = ""
    #: The plugin's validated config section (its ``config_section``), or None.
    config: Any = None
