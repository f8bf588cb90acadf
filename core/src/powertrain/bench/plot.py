"""The latency-vs-load picture: where TTFT and TPOT start to climb as load grows.

Rate sweeps are plotted against the request rate the server actually sustained
(a saturated server completes less than was offered); concurrency sweeps against
the concurrency. Drawn with the Agg backend, so it works without a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

FIGSIZE = (11.0, 4.2)
DPI = 100


def plot_latency_vs_load(result: dict[str, Any], path: str | Path) -> None:
    """Two panels, TTFT and TPOT, each with its p50 and p99 line, one point per load level."""
    levels = sorted(result["levels"], key=lambda level: _x(level) or 0.0)
    by_concurrency = bool(levels) and levels[0]["load"]["mode"] == "concurrency"
    xs = [_x(level) for level in levels]
    figure, axes = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI)
    for ax, metric, title in zip(
        axes, ("ttft_ms", "tpot_ms"), ("time to first token", "time per output token"), strict=True
    ):
        for percentile, style in (("p50", "o-"), ("p99", "s--")):
            points = [(x, level[metric][percentile]) for x, level in zip(xs, levels, strict=True) if x is not None]
            points = [(x, y) for x, y in points if y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], style, label=percentile)
        ax.set_title(title)
        ax.set_xlabel("concurrency" if by_concurrency else "achieved request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    config = result["config"]
    figure.suptitle(f"{config['model']} at {config['base_url']}: {config['workload']} workload")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def _x(level: dict[str, Any]) -> float | None:
    load = level["load"]
    return float(load["target"]) if load["mode"] == "concurrency" else level["request_throughput"]
