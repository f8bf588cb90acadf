"""The engine with tiers below its device cache (issue 26): greedy outputs never change
with tiers on or off, under preemption, on SmolLM2 (GQA), tiny DeepSeek-V3 (MLA), V3.2
(indexer keys) and V4 (sliding-window and compressed groups); the tiers serve hits, a
restart with the same directory serves the conversations from before it, and a damaged
or vanished store only costs misses."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import structlog

from powertrain import LLM, SamplingParams
from powertrain.assemble.planning import AssemblyError, plan
from powertrain.assemble.tiers import build_tiers
from powertrain.config import ConfigError, EngineConfig, parse_config
from powertrain.llm import apply_overrides
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import write_tiny_deepseek, write_tiny_deepseek_v4, write_tiny_deepseek_v32
from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def conversations(rng: random.Random, vocab: int, count: int = 6) -> list[list[int]]:
    """A shared system prompt, then each conversation's own history (its later turns
    resend its earlier ones, as chat clients do)."""
    system = [rng.randrange(vocab) for _ in range(40)]
    return [system + [rng.randrange(vocab) for _ in range(20 + 7 * i)] for i in range(count)]


def serve(settings: dict[str, Any], prompts: list[list[int]], rounds: int = 2) -> tuple[list[list[list[int]]], Any]:
    """Every prompt ``rounds`` times (a later round is the conversation's next turn); the
    tokens of each round and the engine's stats."""
    with LLM(**settings) as llm:
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] for _ in range(rounds)]
        return tokens, llm.engine.stats()


def cacheable(prompts: list[list[int]], block: int) -> int:
    """Prompt tokens a prefix cache can serve at most: whole blocks, one token left to compute."""
    return sum((len(p) - 1) // block * block for p in prompts)


def test_smollm2_tiers_change_nothing_and_a_restart_serves_from_the_directory(tmp_path: Path) -> None:
    seed = fresh_seed()
    prompts = conversations(random.Random(seed), vocab=49152)
    # 10 blocks of 16 tokens: any one request fits, six at once do not (preemptions), and
    # the second round's prefixes were evicted by the first round's later requests.
    base = {"dtype": "float32", "quantization": "dequantize", "num_blocks": 10}
    plain, plain_stats = serve(base, prompts)
    tiered_settings = {**base, "host_memory_gib": 2e-3, "kv_store": "directory", "store_path": str(tmp_path)}
    tiered, stats = serve(tiered_settings, prompts)
    assert tiered == plain, f"tiers changed tokens (seed={seed})"
    assert stats.preemptions > 0
    loaded = stats.prefix_cache_tier_hit_tokens
    assert loaded["host"] > 0 and loaded["directory"] > 0, loaded
    assert stats.prefix_cache_hit_tokens > plain_stats.prefix_cache_hit_tokens + sum(loaded.values()) // 2
    assert stats.kv_tier_bytes_written["directory"] > 0 and stats.kv_tier_errors == {"host": 0, "directory": 0}
    # A new engine on the same directory, with room for every request (no preemption, so each
    # prompt is looked up once, into an empty device cache): the first round is served from
    # blocks computed before the restart.
    restart = {**base, "num_blocks": 64, "kv_store": "directory", "store_path": str(tmp_path)}
    restarted, after = serve(restart, prompts, rounds=1)
    assert restarted[0] == plain[0], f"after a restart (seed={seed})"
    assert after.prefix_cache_tier_hit_tokens["directory"] > 0
    assert after.prefix_cache_hit_tokens >= 0.8 * cacheable(prompts, 16), after


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("v3"), seed=fresh_seed(), num_nextn_predict_layers=0)


def test_deepseek_v3_tiers_change_nothing_and_survive_damage(deepseek_v3: Path, tmp_path: Path) -> None:
    seed = fresh_seed()
    prompts = conversations(random.Random(seed), vocab=500)
    base = {"path": str(deepseek_v3), "dtype": "float32", "num_blocks": 10}
    plain, _ = serve(base, prompts)
    store = {**base, "kv_store": "directory", "store_path": str(tmp_path / "kv")}
    tiered, stats = serve({**store, "host_memory_gib": 1e-4}, prompts)
    assert tiered == plain, f"tiers changed tokens (seed={seed})"
    assert stats.preemptions > 0 and sum(stats.prefix_cache_tier_hit_tokens.values()) > 0, stats
    # Every stored block cut short, as by a writer that died mid-file: misses and warnings, same tokens.
    files = list((tmp_path / "kv").glob("*/*.kvb"))
    assert files
    for file in files:
        file.write_bytes(file.read_bytes()[:-9])
    with structlog.testing.capture_logs() as logs:
        damaged, damaged_stats = serve(store, prompts, rounds=1)
    assert damaged[0] == plain[0], f"after damage (seed={seed})"
    assert any(entry["event"] == "kv store block dropped as a miss" for entry in logs)
    assert damaged_stats.kv_tier_errors == {"directory": 0}
    # The directory vanishes between two rounds: misses with a logged reason, same tokens.
    with LLM(**store) as llm, structlog.testing.capture_logs() as logs:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        shutil.rmtree(tmp_path / "kv")
        second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        errors = llm.engine.stats().kv_tier_errors
    assert [first, second] == plain, f"with the directory gone (seed={seed})"
    assert errors["directory"] > 0
    assert any(entry["event"] == "kv store failing: treated as misses" for entry in logs)


@pytest.mark.parametrize(
    ("write", "block_size"),
    [(write_tiny_deepseek_v32, 16), (write_tiny_deepseek_v4, 8), (write_tiny_deepseek_v41, 4)],
    ids=["v3.2-indexer-keys", "v4-sliding-and-compressed", "v4.1-shared-compressed-and-engram"],
)
def test_deepseek_cache_groups_come_back_from_the_tiers(tmp_path: Path, write: Any, block_size: int) -> None:
    """V3.2's indexer keys (a group beside the MLA latent), V4's sliding-window and compressed
    groups (every layer custom), and V4.1's compressed groups read by later layers (moved
    once, at their source) and Engram's token ids go down and come back with their blocks."""
    seed = fresh_seed()
    path = write(tmp_path / "model", seed=seed)
    prompts = conversations(random.Random(seed), vocab=500, count=4)
    base = {"path": str(path), "dtype": "float32", "block_size": block_size, "num_blocks": 128 // block_size}
    plain, _ = serve(base, prompts)
    tiered, stats = serve({**base, "host_memory_gib": 1.0}, prompts)
    assert tiered == plain, f"tiers changed tokens (seed={seed})"
    assert stats.prefix_cache_tier_hit_tokens["host"] > 0, stats


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_store": "directory"}, "set [cache] store_path"),
        ({"host_memory_gib": 1.0, "prefix_caching": False}, "set [cache] prefix_caching = true"),
        ({"kv_store": "nonexistent"}, "nonexistent"),
    ],
)
def test_tier_settings_that_cannot_work_are_refused_clearly(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(AssemblyError) as error:
        build_tiers(plan(apply_overrides(EngineConfig(), settings)))
    assert message in str(error.value)


def test_bad_tier_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"cache\.host_memory_gib: must be 0 or more"):
        parse_config({"cache": {"host_memory_gib": -1.0}}, "engine.toml")
    with pytest.raises(ConfigError, match=r"cache\.store_gib: must be positive"):
        parse_config({"cache": {"store_gib": 0}}, "engine.toml")


def test_auto_never_picks_a_store_for_the_user() -> None:
    chosen = plan(apply_overrides(EngineConfig(), {"kv_store": "auto"}))
    assert chosen.resolutions["kv_store"].provided is None and build_tiers(chosen) is None


def test_an_engine_counts_the_blocks_its_own_tiers_keep(deepseek_v3: Path, tmp_path: Path) -> None:
    """What the data-parallel balancer reads (WorkerInfo.tier_blocks): host memory counts,
    a shared store (every rank's) does not."""
    settings = {"path": str(deepseek_v3), "dtype": "float32", "num_blocks": 10}
    with LLM(**settings) as plain:
        assert plain.engine.tier_blocks == 0
    shared = {"kv_store": "directory", "store_path": str(tmp_path), "store_gib": 1.0}
    with LLM(**settings, host_memory_gib=0.01, **shared) as llm:
        block_bytes = llm.engine.block_mover.block_bytes[None]
        assert llm.engine.tier_blocks == int(0.01 * 2**30) // block_bytes > 10
