"""The redis KV store on a real server: the conformance kit, the engine's tokens with the
store as its storage tier, a restart served from the server, and a server killed
mid-run (misses with a logged reason, the same tokens)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from powertrain_redis_store.plugin import RedisStoreConfig
from powertrain_redis_store.store import RedisStore

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.interfaces import KVStore, KVStoreContext
from powertrain.testing import KVStoreSuite, PluginContract, fresh_seed, write_tiny_deepseek

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class TestContract(PluginContract):
    plugin = "redis-store"
    vendor_modules = ("redis",)


class TestRedisStore(KVStoreSuite):
    component = "redis"

    @pytest.fixture
    def context(self, redis_server: Any) -> KVStoreContext:
        config = RedisStoreConfig(url=redis_server.url, key_prefix=f"test-{fresh_seed()}:")
        return KVStoreContext(capacity_bytes=None, config=config)

    def damage(self, store: KVStore, key: bytes) -> None:
        assert isinstance(store, RedisStore)
        name = store._name(key)
        value = store.client.get(name)
        store.client.set(name, value[:-3])  # cut short, as by a writer that died


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("v3"), seed=fresh_seed(), num_nextn_predict_layers=0)


def conversations(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(40)]
    return [system + [rng.randrange(500) for _ in range(20 + 7 * i)] for i in range(6)]


def settings_of(checkpoint: Path, redis_url: str | None = None, **more: Any) -> dict[str, Any]:
    """LLM settings; with ``redis_url``, the redis store as the storage tier."""
    settings = {"path": str(checkpoint), "dtype": "float32", "num_blocks": 10, **more}
    if redis_url is None:
        return settings
    section = {"url": redis_url, "timeout_s": 0.5}
    return {**settings, "kv_store": "redis", "config": EngineConfig(sections={"redis_store": section})}


def serve(settings: dict[str, Any], prompts: list[list[int]], rounds: int = 2) -> tuple[list[list[list[int]]], Any]:
    with LLM(**settings) as llm:
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] for _ in range(rounds)]
        return tokens, llm.engine.stats()


def test_the_engine_keeps_its_tokens_and_a_restart_hits_the_server(checkpoint: Path, redis_server: Any) -> None:
    seed = fresh_seed()
    prompts = conversations(seed)
    plain, _ = serve(settings_of(checkpoint), prompts)
    tiered, stats = serve(settings_of(checkpoint, redis_server.url), prompts)
    assert tiered == plain, f"seed={seed}"
    assert stats.prefix_cache_tier_hit_tokens["redis"] > 0 and stats.kv_tier_errors == {"redis": 0}
    assert redis.Redis.from_url(redis_server.url).dbsize() > 0
    restarted, after = serve(settings_of(checkpoint, redis_server.url, num_blocks=64), prompts, rounds=1)
    assert restarted[0] == plain[0], f"after a restart (seed={seed})"
    cacheable = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert after.prefix_cache_hit_tokens >= 0.8 * cacheable, after


def test_a_server_killed_mid_run_costs_misses_not_requests(checkpoint: Path, redis_server: Any) -> None:
    seed = fresh_seed()
    prompts = conversations(seed)
    plain, _ = serve(settings_of(checkpoint), prompts)
    with LLM(**settings_of(checkpoint, redis_server.url)) as llm, structlog.testing.capture_logs() as logs:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        redis_server.stop()
        second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        errors = llm.engine.stats().kv_tier_errors
    assert [first, second] == plain, f"seed={seed}"
    assert errors["redis"] > 0
    assert any(entry["event"] == "kv store failing: treated as misses" for entry in logs)


def test_a_prefill_rank_hands_its_blocks_to_a_decode_rank_through_the_server(
    checkpoint: Path, redis_server: Any
) -> None:
    """Prefill/decode disaggregation over a networked store: the colocated tokens, every
    prompt handed over, every long prompt a hit on the decode rank."""
    seed = fresh_seed()
    prompts = conversations(seed)
    plain, _ = serve(settings_of(checkpoint), prompts, rounds=1)
    pd = {"data_parallel": 2, "prefill_ranks": 1, "prefill_rank_min_tokens": 0}
    with LLM(**settings_of(checkpoint, redis_server.url, **pd)) as llm:
        outputs = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
    assert [[list(o.outputs[0].token_ids) for o in outputs]] == plain, f"seed={seed}"
    assert (stats.handoffs, stats.handoff_failures) == (len(prompts), 0)
    assert all(o.num_cached_tokens > 0 for o in outputs), [o.num_cached_tokens for o in outputs]
