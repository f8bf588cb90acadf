"""From how many rows ``NativeQuantizedLinear`` multiplies by the weight dequantised a block
at a time (torch's float32 ``F.linear``: MKL) instead of running its native kernel, on this
machine: timed once, then kept in the user's cache folder (``powertrain.measurements``).

Neither wins everywhere. On a 2-core Zen 4 VM the native kernel won at every row count
(``tuning.GEMV_MAX_ROWS``: 30 layers + head at 2048 rows 2762 vs 2995 ms). On a 2-core Xeon
whose AVX-512 FMAs run at full width, MKL's float32 GEMM reached about 260 GFLOP/s where the
native panels reach about 180, and the dense route won from 128 rows on
(``benchmarks/quantized_linear.py``, SmolLM2's 30 layers + head, ms at 64 / 128 / 512 / 2048
rows: native 106 / 212 / 839 / 3395, dense 112 / 164 / 523 / 2342). So both are timed on
throwaway q4 weights of two layer shapes at ``ROWS``; the native kernel keeps every count
below the smallest from which the dense route is faster on each weight at each larger count.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
import torch

import powertrain_cpu_kernels._native as _native
from powertrain.builtin.platforms import cpu_model
from powertrain.interfaces.quantized import QuantizedWeight
from powertrain.layers.linear_choice import best_time, shape_label
from powertrain.measurements import MeasurementFile
from powertrain_cpu_kernels.tuning import GEMV_MAX_ROWS

log = structlog.get_logger(__name__)

#: Rows of activations timed: a batch of decodes up to a prefill chunk's worth.
ROWS = (64, 128, 256, 512)
#: (out, in) of the throwaway weights: SmolLM2-135M's MLP up and down projections' halves.
SHAPES = ((1536, 576), (576, 1536))

#: Milliseconds per shape label, per row count, per route ("native", "dense").
Times = dict[str, dict[str, dict[str, float]]]
#: Times both routes of a kernel; given the kernel (its thread count and settings).
RouteTimer = Callable[[Any], Times]


def throwaway_weight(shape: tuple[int, int], gen: torch.Generator) -> QuantizedWeight:
    rows, cols = shape
    return QuantizedWeight(
        codes=torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8),
        scales=torch.rand(rows, cols // 32, generator=gen) * 1e-2,
        offsets=torch.rand(rows, cols // 32, generator=gen) * -1e-2,
        format="q4",
        group=32,
        source="throwaway q4 weight (timing)",
    )


def time_routes(kernel: Any) -> Times:
    """Both routes of ``kernel`` on the throwaway weights at ``ROWS``."""
    gen = torch.Generator().manual_seed(0)
    times: Times = {}
    with torch.no_grad():
        for shape in SHAPES:
            prepared = kernel.prepare(throwaway_weight(shape, gen))
            per_rows = times[shape_label(shape)] = {}
            for rows in ROWS:
                x = torch.randn(rows, shape[1], generator=gen)
                per_rows[str(rows)] = {
                    route: round(best_time(run) * 1e3, 4)
                    for route, run in (
                        ("native", partial(kernel._native_linear, x, prepared)),
                        ("dense", partial(kernel._dense_linear, x, prepared, None)),
                    )
                }
    return times


def native_max_rows_from(times: Times) -> int:
    """The most rows the native kernel keeps: one below the smallest timed count from which
    the dense route is faster on every weight at every larger count (no limit if none)."""
    counts = sorted({int(rows) for per_rows in times.values() for rows in per_rows})
    first = None
    for rows in reversed(counts):
        if all(per_rows[str(rows)]["dense"] < per_rows[str(rows)]["native"] for per_rows in times.values()):
            first = rows
        else:
            break
    return GEMV_MAX_ROWS if first is None else first - 1


def valid_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("choice"), int) and isinstance(entry.get("ms"), dict)


CACHE = MeasurementFile("cpu_native_dense_route.json", 1, valid_entry, "cpu-native dense route cache")


def native_max_rows(kernel: Any, timer: RouteTimer | None = None) -> int:
    """``gemv_max_rows`` for ``kernel`` on this machine: cached, else timed with ``timer``
    (``time_routes`` unless given) and cached."""
    key = (
        f"{cpu_model() or 'unknown cpu'} | torch {torch.__version__} | {kernel.threads} threads | "
        f"{_native.kernel_path()} kernels | {kernel.dense_block} dense block"
    )

    def measure() -> dict:
        times = (timer or time_routes)(kernel)
        return {"choice": native_max_rows_from(times), "ms": times}

    entries, measured = CACHE.entries({key: measure})
    limit = entries[key]["choice"]
    log.info(
        "cpu-native: dense route chosen by timing",
        dense_from_rows=None if limit >= GEMV_MAX_ROWS else limit + 1,
        measured=measured,
        cache=str(CACHE.path),
    )
    return limit
