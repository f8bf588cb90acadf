"""Which CPU linear implementation each weight shape runs: timed once per machine, then cached.

Neither candidate wins everywhere: oneDNN with a weight packed once at load beats
MKL's ``F.linear`` on AMD and on wide matrices like an LM head, while MKL can win on
small decode matrices on Intel parts. So nothing is assumed. Each weight shape is
timed with both, on a throwaway weight of that shape and dtype (never the model's), at
one row (a decode step) and 64 rows (a batch); the lower sum wins. The results are
kept in a small JSON file keyed by CPU model, torch version, thread count, dtype and
shape, so a machine measures each shape once; delete the file to measure again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from powertrain.measurements import MeasurementFile

PLAIN = "f.linear"
PACKED = "onednn-packed"
CANDIDATES = (PLAIN, PACKED)  # on a tie, the first: no packing
#: Rows of activations each candidate is timed at: a decode step, and a prefill or a batch of decodes.
ROW_CLASSES = {"decode": 1, "batch": 64}
#: Timed runs per candidate and row class (best kept), fewer for a shape whose best run
#: is heavy, once they have taken ``BUDGET_S``: a 49152x576 head, at ~10 ms a call, gets
#: one after its warm-up, while a light shape slowed once by a busy core still gets all.
REPEATS = 5
BUDGET_S = 0.01

#: Seconds (best of the runs) per candidate, per row class.
Times = dict[str, dict[str, float]]
#: Times both candidates on a (out_features, in_features) weight of a dtype.
ShapeTimer = Callable[[tuple[int, int], torch.dtype], Times]


@attrs.frozen
class LinearChoice:
    #: The candidate chosen for each (out_features, in_features).
    shapes: dict[tuple[int, int], str]
    #: Milliseconds per "OUTxIN", per candidate, per row class (fresh or from the cache).
    ms: dict[str, dict[str, dict[str, float]]]
    #: Whether any shape was timed now (False: all came from the cache).
    measured: bool
    cache: Path


def shape_label(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def throwaway_weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A random weight of ``shape``; at most 1024 random rows, repeated, since drawing a
    whole 49152-row head costs more than timing it."""
    out_features, in_features = shape
    block = torch.randn(min(out_features, 1024), in_features) / in_features**0.5
    return block.repeat(math.ceil(out_features / block.shape[0]), 1)[:out_features].to(dtype).contiguous()


def best_time(run: Callable[[], Any]) -> float:
    run()  # warm-up: oneDNN builds its primitive on the first call of a shape
    best, spent = math.inf, 0.0
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        spent += elapsed
        if spent >= BUDGET_S and best >= BUDGET_S / REPEATS:  # heavy, not one slow run of a light shape
            break
    return best


def time_shape(shape: tuple[int, int], dtype: torch.dtype) -> Times:
    """Both candidates on a throwaway weight of ``shape``, at each row class."""
    weight = throwaway_weight(shape, dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    times: Times = {PLAIN: {}, PACKED: {}}
    with torch.no_grad():
        for row_class, rows in ROW_CLASSES.items():
            x = torch.randn(rows, shape[1]).to(dtype)
            times[PLAIN][row_class] = best_time(partial(F.linear, x, weight))
            pointwise = partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
            times[PACKED][row_class] = best_time(pointwise)
    return times


def cache_path() -> Path:
    """``linear_choice.json`` in ``measurements.cache_folder()``."""
    return CACHE.path


def cache_key(cpu: str, torch_version: str, threads: int, dtype: torch.dtype, shape: tuple[int, int]) -> str:
    """What a timing depends on: the CPU, torch's kernels, the threads they use, the dtype, the shape."""
    return f"{cpu} | torch {torch_version} | {threads} threads | {dtype} | {shape_label(shape)}"


def valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and entry.get("choice") in CANDIDATES
        and isinstance(entry.get("ms"), dict)
        and all(isinstance(entry["ms"].get(candidate), dict) for candidate in CANDIDATES)
    )


CACHE = MeasurementFile("linear_choice.json", 1, valid_entry, "linear choice cache")


def measured_entry(timer: ShapeTimer, shape: tuple[int, int], dtype: torch.dtype) -> dict:
    """The cache entry for ``shape``, timed now: the faster candidate and every candidate's ms."""
    times = timer(shape, dtype)
    best = min(CANDIDATES, key=lambda candidate: sum(times[candidate].values()))
    return {"choice": best, "ms": {c: {row: round(s * 1e3, 4) for row, s in times[c].items()} for c in CANDIDATES}}


def choose(
    shapes: Iterable[tuple[int, int]], dtype: torch.dtype, cpu: str, timer: ShapeTimer | None = None
) -> LinearChoice:
    """The faster candidate for each weight shape on this CPU, from the cache or timed now
    with ``timer`` (``time_shape`` unless given) and then cached."""
    timer = timer or time_shape
    keys = {
        shape: cache_key(cpu, torch.__version__, torch.get_num_threads(), dtype, shape) for shape in sorted(set(shapes))
    }
    entries, measured = CACHE.entries(
        {key: partial(measured_entry, timer, shape, dtype) for shape, key in keys.items()}
    )
    chosen = {shape: entries[key]["choice"] for shape, key in keys.items()}
    ms = {shape_label(shape): entries[key]["ms"] for shape, key in keys.items()}
    return LinearChoice(shapes=chosen, ms=ms, measured=measured, cache=CACHE.path)
