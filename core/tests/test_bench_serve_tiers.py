"""``powertrain bench serve`` against a real powertrain server with a host tier below its
(small) device cache: each load level reports the share of prompt tokens each tier
served, read from the server's /metrics, and it agrees with what /metrics says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from click.testing import CliRunner

from powertrain.assemble import build_engine
from powertrain.cli import main
from powertrain.config import EngineConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import write_tiny_deepseek
from powertrain.testing.server import running_server


def counter(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(value) for value in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_bench_serve_reports_hit_rates_per_tier(tmp_path: Path) -> None:
    checkpoint = write_tiny_deepseek(tmp_path / "v3", seed=fresh_seed(), num_nextn_predict_layers=0)
    settings = {"path": str(checkpoint), "dtype": "float32", "num_blocks": 20, "host_memory_gib": 0.01}
    config = apply_overrides(EngineConfig(), settings)
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(build_engine(config, plugins))
    output = tmp_path / "run.json"
    try:
        adapter = protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
        with running_server(engine, adapter) as url:
            args = ["bench", "serve", "--base-url", url, "--workload", "multi-turn", "--concurrency", "4"]
            args += ["--conversations", "6", "--turns", "3", "--input-len", "10:15", "--output-len", "6"]
            args += ["--temperature", "0", "--output", str(output)]
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
            queried = counter(url, "powertrain_prefix_cache_queries_total")
            from_host = counter(url, "powertrain_prefix_cache_tier_hits_total")
    finally:
        engine.shutdown()
    assert "tier hits" in result.output and "host" in result.output
    [level] = json.loads(output.read_text())["levels"]
    assert level["requests"]["failed"] == 0, level["errors"]
    rates = level["prefix_cache_tier_hit_rates"]
    assert from_host > 0, "the conversations outgrew 20 blocks: their earlier turns come back from host memory"
    assert abs(rates["host"] - from_host / queried) < 1e-9, (rates, from_host, queried)
