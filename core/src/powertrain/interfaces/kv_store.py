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

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

#: One stored block: its key and its payload.
StoredBlock = tuple[bytes, torch.Tensor]

BLOCK_MAGIC = b"PTKVBLK1"
#: magic, key length (u32), payload length (u64), the payload's BLAKE2b-128; then the key
#: and the payload.
BLOCK_HEADER = struct.Struct("<8sIQ16s")


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


# --------------------------------------------------------------------------- framing


def frame_block(key: bytes, payload: torch.Tensor) -> tuple[bytes, memoryview]:
    """A block as bytes a store can keep: a header with the key, the payload's length and
    digest (the first part), then the payload itself (the second, not copied). A store of
    bytes (files, a key-value server) writes both parts and checks what it reads back with
    ``unframe_block``, so it can never return a torn or foreign entry."""
    data = payload.contiguous().numpy()
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return BLOCK_HEADER.pack(BLOCK_MAGIC, len(key), data.nbytes, digest) + key, memoryview(data).cast("B")


def unframe_block(key: bytes, data: bytes | bytearray | memoryview) -> torch.Tensor | str:
    """The payload ``frame_block`` framed under ``key``, or why ``data`` is not that
    (cut short, longer, damaged, another key's)."""
    view = memoryview(data).cast("B")
    if len(view) < BLOCK_HEADER.size:
        return "shorter than its header"
    magic, key_len, size, digest = BLOCK_HEADER.unpack_from(view)
    if magic != BLOCK_MAGIC:
        return "not a powertrain KV block"
    start = BLOCK_HEADER.size + key_len
    if bytes(view[BLOCK_HEADER.size : start]) != key:
        return "holds another key"
    if len(view) != start + size:
        return f"holds {len(view) - start} payload bytes where its header says {size}"
    payload = view[start:]
    if hashlib.blake2b(payload, digest_size=16).digest() != digest:
        return "fails its checksum"
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
