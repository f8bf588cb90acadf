"""The load picture: where TTFT and TPOT climb and output throughput flattens as load grows.

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
from matplotlib.figure import Figure  # noqa: E402

FIGSIZE = (15.0, 4.2)
DPI = 100
LATENCY_PANELS = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"))


def plot_latency_vs_load(result: dict[str, Any], path: str | Path) -> None:
    """Write `latency_vs_load_figure` as a PNG."""
    figure = latency_vs_load_figure(result)
    try:
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)


def latency_vs_load_figure(result: dict[str, Any]) -> Figure:
    """Three panels, one point per load level: TTFT and TPOT (p50 and p99 lines each), and
    output tokens/s, which shows whether the extra latency bought any throughput."""
    levels = sorted(result["levels"], key=lambda level: _x(level) or 0.0)
    by_concurrency = bool(levels) and levels[0]["load"]["mode"] == "concurrency"
    xs = [_x(level) for level in levels]
    figure, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI)
    for ax, (metric, title) in zip(axes, LATENCY_PANELS, strict=False):
        for percentile, style in (("p50", "o-"), ("p99", "s--")):
            _line(ax, _points(xs, [level[metric][percentile] for level in levels]), style, percentile)
        _style(ax, title, "ms", by_concurrency)
    throughput = axes[2]
    _line(throughput, _points(xs, [level["output_throughput"] for level in levels]), "o-", "output")
    _style(throughput, "output throughput", "output tokens/s", by_concurrency)
    config = result["config"]
    figure.suptitle(f"{config['model']} at {config['base_url']}: {config['workload']} workload")
    figure.tight_layout()
    return figure


def _points(xs: list[float | None], ys: list[float | None]) -> list[tuple[float, float]]:
    """The (x, y) pairs where both were measured (a level with no completed request has neither)."""
    return [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]


def _line(ax: Any, points: list[tuple[float, float]], style: str, label: str) -> None:
    ax.plot([x for x, _ in points], [y for _, y in points], style, label=label)


def _style(ax: Any, title: str, unit: str, by_concurrency: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel("concurrency" if by_concurrency else "achieved request rate (req/s)")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _x(level: dict[str, Any]) -> float | None:
    load = level["load"]
    return float(load["target"]) if load["mode"] == "concurrency" else level["request_throughput"]
