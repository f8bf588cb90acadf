"""From raw request results to the numbers people compare: percentiles, throughput, cache hits.

Latencies are reported in milliseconds over successful requests only; failures are
counted separately with their first messages, so a fast failure never flatters a
percentile.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from powertrain.bench.load import LevelRun
from powertrain.builtin.platforms import cpu_model

PERCENTILES = (50, 90, 99)
FIRST_ERRORS = 5


def latency_stats(seconds: list[float]) -> dict[str, Any]:
    """Mean and p50/p90/p99 in ms (linear interpolation); None when nothing was measured."""
    if not seconds:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    values = np.percentile(ms, PERCENTILES)
    return {
        "count": len(ms),
        "mean": float(ms.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, values, strict=True)},
    }


def summarize(run: LevelRun) -> dict[str, Any]:
    """One load level's metrics, as written to the JSON result."""
    ok = [r for r in run.results if r.ok]
    errors = [r.error for r in run.results if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    # The hit rate counts only requests whose server said how many prompt tokens were cached.
    reporting = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reporting)
    cache_prompt = sum(r.prompt_tokens for r in reporting)
    duration = run.duration
    return {
        "load": run.load.to_json(),
        "requests": {
            "planned": run.planned,
            "sent": len(run.results),
            "completed": len(ok),
            "failed": len(errors),
            "skipped": run.skipped,
            "without_usage": sum(1 for r in ok if not r.usage_reported),
        },
        "duration_s": duration,
        "client_cpu_s": run.client_cpu_s,
        "peak_concurrency": run.peak_concurrency,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": output / duration if duration > 0 else None,
        "total_token_throughput": (prompt + output) / duration if duration > 0 else None,
        "tokens": {"prompt": prompt, "output": output, "cached": cached if reporting else None},
        "prefix_cache_hit_rate": cached / cache_prompt if cache_prompt else None,
        "prefix_cache_tier_hit_rates": tier_hit_rates(run),
        "ttft_ms": latency_stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": latency_stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in ok if r.e2e is not None]),
        "errors": {"count": len(errors), "first": errors[:FIRST_ERRORS]},
    }


def tier_hit_rates(run: LevelRun) -> dict[str, float] | None:
    """Per tier below the device cache, the share of the level's looked-up prompt tokens it
    served (from the server's /metrics); None where the server does not say."""
    if run.cache_counters is None:
        return None
    before, after = run.cache_counters
    queried = after["queried"] - before.get("queried", 0.0)
    return {
        key.removeprefix("tier:"): (value - before.get(key, 0.0)) / queried if queried > 0 else 0.0
        for key, value in after.items()
        if key.startswith("tier:")
    }


def machine() -> dict[str, Any]:
    """The client machine: a saturated client shows up as server latency."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "executable": os.path.basename(sys.executable),
    }


def print_table(result: dict[str, Any], console: Console) -> None:
    """The load levels as rows: throughput, p50/p99 latencies, cache hits and errors."""
    config = result["config"]
    table = Table(title=f"bench serve: {config['model']} at {config['base_url']} ({config['workload']})")
    columns = [
        "load",
        "ok/sent",
        "errors",
        "req/s",
        "out tok/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "ITL p50/p99 ms",
    ]
    tiers = any(level.get("prefix_cache_tier_hit_rates") for level in result["levels"])
    for column in [*columns, "E2E p50/p99 ms", "cache hit", *(["tier hits"] if tiers else [])]:
        table.add_column(column, justify="right")
    for level in result["levels"]:
        requests = level["requests"]
        hit = level["prefix_cache_hit_rate"]
        by_tier = level.get("prefix_cache_tier_hit_rates") or {}
        table.add_row(
            _load_label(level["load"]),
            f"{requests['completed']}/{requests['sent']}",
            f"[red]{requests['failed']}[/]" if requests["failed"] else "0",
            _number(level["request_throughput"], 2),
            _number(level["output_throughput"], 1),
            _pair(level["ttft_ms"]),
            _pair(level["tpot_ms"]),
            _pair(level["itl_ms"]),
            _pair(level["e2e_ms"]),
            "-" if hit is None else f"{hit:.1%}",
            *([" ".join(f"{name} {rate:.1%}" for name, rate in by_tier.items()) or "-"] if tiers else []),
        )
    console.print(table)
    for level in result["levels"]:
        for message in level["errors"]["first"]:
            console.print(f"{_load_label(level['load'])}: error: {message}", highlight=False)


def _load_label(load: dict[str, Any]) -> str:
    target = load["target"]
    return f"rate {target:g}/s" if load["mode"] == "rate" and target != "inf" else f"{load['mode']} {target}"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pair(stats: dict[str, Any]) -> str:
    return f"{_number(stats['p50'], 1)} / {_number(stats['p99'], 1)}"
