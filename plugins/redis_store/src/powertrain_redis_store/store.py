"""The ``redis`` KV store: one string value per block, framed with its key, length and
checksum (``interfaces.kv_store.frame_block``), so a value that was cut short, damaged or
written under another key reads as a miss, never as a payload.

Capacity is the server's business: give it a ``maxmemory`` and an ``allkeys-lru``
policy, or set ``[redis_store] ttl_s``. Every call is one pipelined round trip for the
whole batch, with a timeout, so a server that dies costs a miss per lookup (the tiers
log it), never a stalled engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import structlog
import torch

from powertrain.interfaces.kv_store import StoredBlock, frame_block, unframe_block

log = structlog.get_logger(__name__)


class RedisStore:
    shared = True

    def __init__(self, config: Any, capacity_bytes: int | None) -> None:
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.client = redis.Redis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        self._prefix = config.key_prefix.encode()

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        return [bool(found) for found in pipe.execute()]

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        if not keys:
            return []
        values = self.client.mget([self._name(key) for key in keys])
        payloads: list[torch.Tensor | None] = []
        for key, value in zip(keys, values, strict=True):
            payload = None if value is None else unframe_block(key, value)
            if isinstance(payload, str):
                log.warning("kv store block dropped as a miss", store="redis", key=key.hex(), why=payload)
                self.client.delete(self._name(key))
                payload = None
            payloads.append(payload)
        return payloads

    def put(self, blocks: Sequence[StoredBlock]) -> list[StoredBlock]:
        pipe = self.client.pipeline(transaction=False)
        for key, payload in blocks:
            header, data = frame_block(key, payload)
            pipe.set(self._name(key), header + data, nx=True, ex=self.config.ttl_s or None)
        pipe.execute()
        return []

    def evict(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.client.delete(*[self._name(key) for key in keys])

    def close(self) -> None:
        self.client.close()
