"""The host-memory KV store (the host tier; registered as the builtin ``host-memory``):
payloads in this process's memory, least recently used dropped first once
``capacity_bytes`` is reached (handed back to the caller, who passes them to the tier
below)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from powertrain.interfaces.kv_store import KVStoreContext, StoredBlock


class HostMemoryStore:
    shared = False

    def __init__(self, capacity_bytes: int | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # the engine thread reads while the tier writer puts

    @classmethod
    def build(cls, context: KVStoreContext) -> HostMemoryStore:
        return cls(context.capacity_bytes)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._blocks for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        with self._lock:
            found = []
            for key in keys:
                payload = self._blocks.get(key)
                if payload is not None:
                    self._blocks.move_to_end(key)
                found.append(payload)
            return found

    def put(self, blocks: Sequence[StoredBlock]) -> list[StoredBlock]:
        dropped: list[StoredBlock] = []
        with self._lock:
            for key, payload in blocks:
                size = payload.numel()
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                if self.capacity_bytes is not None and size > self.capacity_bytes:
                    dropped.append((key, payload))  # never fits: straight to the tier below
                    continue
                self._blocks[key] = payload
                self.used_bytes += size
                while self.capacity_bytes is not None and self.used_bytes > self.capacity_bytes:
                    old_key, old = self._blocks.popitem(last=False)
                    self.used_bytes -= old.numel()
                    dropped.append((old_key, old))
        return dropped

    def evict(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                payload = self._blocks.pop(key, None)
                if payload is not None:
                    self.used_bytes -= payload.numel()

    def drain(self) -> list[StoredBlock]:
        """Everything held, oldest first, and nothing left (handed down at shutdown)."""
        with self._lock:
            blocks = list(self._blocks.items())
            self._blocks.clear()
            self.used_bytes = 0
        return blocks

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.used_bytes = 0
