"""The row count from which ``cpu-native`` takes its dense route: chosen from timings (a
rule checked on made-up ones), timed for real on this machine once, then read from the
cache; a damaged cache is measured over, and the plugin's kernel takes the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from powertrain_cpu_kernels import NativeQuantizedLinear
from powertrain_cpu_kernels.dense_route import (
    ROWS,
    SHAPES,
    native_max_rows,
    native_max_rows_from,
    throwaway_weight,
    time_routes,
)
from powertrain_cpu_kernels.torch_openmp import gomp_parallel_address
from powertrain_cpu_kernels.tuning import GEMV_MAX_ROWS


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POWERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def times(dense_wins: dict[str, set[int]]) -> dict:
    """Made-up timings: per shape, the row counts at which the dense route is faster."""
    return {
        shape: {str(rows): {"native": 2.0, "dense": 1.0 if rows in wins else 3.0} for rows in ROWS}
        for shape, wins in dense_wins.items()
    }


@pytest.mark.parametrize(
    ("dense_wins", "expected"),
    [
        ({"a": {128, 256, 512}, "b": {128, 256, 512}}, 127),
        ({"a": {64, 128, 256, 512}, "b": {128, 256, 512}}, 127),  # both weights must gain
        ({"a": {64, 256, 512}, "b": {64, 256, 512}}, 255),  # and at every larger count
        ({"a": {512}, "b": {512}}, 511),
        ({"a": {64, 128, 256}, "b": {64, 128, 256}}, GEMV_MAX_ROWS),  # not at the largest: never
        ({"a": set(), "b": set()}, GEMV_MAX_ROWS),
    ],
)
def test_the_native_kernel_keeps_the_rows_below_a_lasting_dense_win(dense_wins, expected) -> None:
    assert native_max_rows_from(times(dense_wins)) == expected


def test_the_routes_are_timed_for_real_on_every_shape_and_row_count() -> None:
    measured = time_routes(NativeQuantizedLinear(gemv_max_rows=GEMV_MAX_ROWS))
    assert set(measured) == {f"{rows}x{cols}" for rows, cols in SHAPES}
    for per_rows in measured.values():
        assert set(per_rows) == {str(rows) for rows in ROWS}
        assert all(t["native"] > 0 and t["dense"] > 0 for t in per_rows.values()), per_rows


def test_timed_once_then_read_from_the_cache(cache_dir: Path) -> None:
    calls = []

    def timer(kernel):
        calls.append(kernel.threads)
        return times({"a": {256, 512}})

    kernel = NativeQuantizedLinear(threads=2)
    assert native_max_rows(kernel, timer) == 255 and calls == [2]
    assert native_max_rows(kernel, timer) == 255 and calls == [2]  # cached
    assert native_max_rows(NativeQuantizedLinear(threads=1), timer) == 255 and calls == [2, 1]  # another key
    entries = json.loads((cache_dir / "cpu_native_dense_route.json").read_text())["choices"]
    assert sorted(entry["choice"] for entry in entries.values()) == [255, 255]


@pytest.mark.parametrize("damage", ["{not json", '{"format": 1, "choices": {"k": {"choice": "many"}}}', b"\xff\xfe"])
def test_a_damaged_cache_is_measured_over(cache_dir: Path, damage: str | bytes) -> None:
    cache_dir.mkdir(parents=True)
    path = cache_dir / "cpu_native_dense_route.json"
    path.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    calls = []

    def timer(kernel):
        calls.append(1)
        return times({"a": {128, 256, 512}})

    assert native_max_rows(NativeQuantizedLinear(), timer) == 127 and calls == [1]
    assert json.loads(path.read_text())["format"] == 1  # rewritten whole


@pytest.mark.skipif(not gomp_parallel_address(), reason="the kernel runs on its own pool here: decode rows only")
def test_the_plugins_kernel_takes_the_cached_choice(cache_dir: Path) -> None:
    kernel = NativeQuantizedLinear.for_this_cpu()  # times this machine once
    entries = json.loads((cache_dir / "cpu_native_dense_route.json").read_text())["choices"]
    (key,) = entries
    assert kernel.gemv_max_rows == entries[key]["choice"]
    # A planted choice is what the next kernel runs with, and its route follows it.
    entries[key]["choice"] = 7
    (cache_dir / "cpu_native_dense_route.json").write_text(json.dumps({"format": 1, "choices": entries}))
    kernel = NativeQuantizedLinear.for_this_cpu()
    assert kernel.gemv_max_rows == 7
    gen = torch.Generator().manual_seed(0)
    prepared = kernel.prepare(throwaway_weight((64, 96), gen))
    dense = kernel.dequantize(prepared)
    for rows, route in ((7, "native"), (8, "dense")):
        x = torch.randn(rows, 96, generator=gen)
        got = kernel.linear(x, prepared, None)
        # The dense route is F.linear on the dequantised weight, bit for bit; the native
        # kernel's panels round differently.
        assert torch.equal(got, F.linear(x, dense)) == (route == "dense"), route
        torch.testing.assert_close(got, F.linear(x, dense), rtol=1e-5, atol=1e-5)
