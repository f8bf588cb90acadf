"""Registers the ``redis`` KV store and its ``[redis_store]`` config section."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from powertrain import hookimpl
from powertrain.components import ConfigSectionRecord, KVStoreRecord

if TYPE_CHECKING:  # importing the plugin stays cheap: no client until a store is built
    from powertrain.interfaces import KVStoreContext
    from powertrain_redis_store.store import RedisStore

POWERTRAIN_HOOK_API = 1


@attrs.frozen(kw_only=True)
class RedisStoreConfig:
    #: The server (redis://, rediss:// or unix://); Valkey speaks the same protocol.
    url: str = "redis://localhost:6379/0"
    #: Prepended to every key, so engines can share a server with other users.
    key_prefix: str = "powertrain:kv:"
    #: Seconds a block is kept (0: until the server's own eviction policy drops it).
    ttl_s: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: A call that takes longer fails (and counts as a miss): a dead server never stalls a step for long.
    timeout_s: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))


def build_redis(context: KVStoreContext) -> RedisStore:
    from powertrain_redis_store.store import RedisStore

    return RedisStore(context.config or RedisStoreConfig(), context.capacity_bytes)


@hookimpl
def powertrain_kv_stores() -> list[KVStoreRecord]:
    return [
        KVStoreRecord(
            name="redis",
            factory=build_redis,
            config_section="redis_store",
            description="a Redis or Valkey server, shared between engines and kept across restarts",
        )
    ]


@hookimpl
def powertrain_config_sections() -> list[ConfigSectionRecord]:
    return [ConfigSectionRecord(name="redis_store", config_class=RedisStoreConfig, description="the redis KV store")]
