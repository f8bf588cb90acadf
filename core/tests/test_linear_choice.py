"""Choosing F.linear or a oneDNN-packed weight per shape by timing (layers/linear_choice.py).

The timer is injected, so which candidate "wins" is forced and the tests assert exactly
which Linears of a real model end up packed, that outputs still match F.linear on the
dense weight, and how the per-machine cache is written, read, distrusted and keyed.
One test runs the real timer and checks only that it chooses for every shape: timing
on a shared machine is noise, never asserted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
import torch.nn.functional as F
from torch import nn

from powertrain.builtin.platforms import detect_cpu
from powertrain.layers import linear_choice
from powertrain.layers.linear import Linear, pack_for_platform
from powertrain.layers.linear_choice import PACKED, PLAIN, ROW_CLASSES, Times, cache_key, cache_path
from powertrain.testing import fresh_seed

CPU = detect_cpu()

pytestmark = pytest.mark.skipif(torch.float32 not in CPU.packed_linear_dtypes, reason=CPU.linear_packing_note)

CHOSEN = "linear implementation chosen"
#: Packed wins for (48, 32) (two layers share it), plain for (80, 32) and (32, 48).
WINNERS = {(48, 32): PACKED, (80, 32): PLAIN, (32, 48): PLAIN}


class RecordingTimer:
    """Says ``winners[shape]`` is faster (1 ms against 2 ms at every row class), and records its calls."""

    def __init__(self, winners: dict[tuple[int, int], str]) -> None:
        self.winners = winners
        self.calls: list[tuple[tuple[int, int], torch.dtype]] = []

    def __call__(self, shape: tuple[int, int], dtype: torch.dtype) -> Times:
        self.calls.append((shape, dtype))
        return {
            candidate: dict.fromkeys(ROW_CLASSES, 0.001 if candidate == self.winners[shape] else 0.002)
            for candidate in (PLAIN, PACKED)
        }


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POWERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def logs() -> Iterator[list[dict]]:
    """structlog events at info and above, whatever an earlier test configured."""
    configured, saved = structlog.is_configured(), structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as captured:
            yield captured
    finally:
        if configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


def small_model(seed: int) -> nn.ModuleDict:
    """Four powertrain Linears, two of them sharing a shape, one with a bias."""
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "q": Linear(32, 48, bias=True),
            "k": Linear(32, 48, bias=False),
            "up": Linear(32, 80, bias=False),
            "down": Linear(48, 32, bias=False),
        }
    )


def test_packs_exactly_the_shapes_whose_packed_timing_won(cache_dir: Path, logs: list[dict]) -> None:
    seed = fresh_seed()
    model = small_model(seed)
    dense = {name: (layer.weight.detach().clone(), layer.bias) for name, layer in model.items()}
    timer = RecordingTimer(WINNERS)

    assert pack_for_platform(model, CPU, torch.float32, timer=timer) == 2
    assert sorted(timer.calls) == sorted((shape, torch.float32) for shape in WINNERS)  # once per shape
    assert {name for name, layer in model.items() if layer.packed is not None} == {"q", "k"}
    assert all(layer.weight is None for name, layer in model.items() if name in {"q", "k"})
    assert all(layer.weight is not None for name, layer in model.items() if name in {"up", "down"})

    generator = torch.Generator().manual_seed(seed)
    for name, layer in model.items():
        x = torch.randn(5, 3, layer.in_features, generator=generator)
        weight, bias = dense[name]
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)

    (line,) = [entry for entry in logs if entry["event"] == CHOSEN]
    assert line["log_level"] == "info" and line["measured"] is True and line["dtype"] == "torch.float32"
    assert line["shapes"] == {"48x32": PACKED, "80x32": PLAIN, "32x48": PLAIN}
    assert (line["packed_layers"], line["plain_layers"]) == (2, 2)
    assert line["ms"]["48x32"] == {PACKED: {"decode": 1.0, "batch": 1.0}, PLAIN: {"decode": 2.0, "batch": 2.0}}
    assert line["cache"] == str(cache_dir / "linear_choice.json")


def test_a_second_load_reads_the_cache_without_timing(cache_dir: Path, logs: list[dict]) -> None:
    pack_for_platform(small_model(fresh_seed()), CPU, torch.float32, timer=RecordingTimer(WINNERS))
    stored = json.loads((cache_dir / "linear_choice.json").read_text())
    assert len(stored["choices"]) == 3
    key = cache_key(CPU.device_name, torch.__version__, torch.get_num_threads(), torch.float32, (48, 32))
    assert stored["choices"][key]["choice"] == PACKED

    untimed = RecordingTimer({})  # any call would fail on the missing shape, and is recorded first
    model = small_model(fresh_seed())
    assert pack_for_platform(model, CPU, torch.float32, timer=untimed) == 2
    assert untimed.calls == []
    assert {name for name, layer in model.items() if layer.packed is not None} == {"q", "k"}
    second = [entry for entry in logs if entry["event"] == CHOSEN][-1]
    assert second["measured"] is False and second["ms"]["80x32"][PLAIN] == {"decode": 1.0, "batch": 1.0}


def test_only_shapes_missing_from_the_cache_are_timed(cache_dir: Path) -> None:
    linear_choice.choose([(48, 32)], torch.float32, "cpu-a", RecordingTimer(WINNERS))
    timer = RecordingTimer(WINNERS)
    choice = linear_choice.choose([(48, 32), (80, 32)], torch.float32, "cpu-a", timer)
    assert timer.calls == [((80, 32), torch.float32)] and choice.measured
    assert choice.shapes == {(48, 32): PACKED, (80, 32): PLAIN}
    assert len(json.loads((cache_dir / "linear_choice.json").read_text())["choices"]) == 2  # merged


@pytest.mark.parametrize(
    "damage",
    [
        "{not json",
        "[]",
        json.dumps({"format": 1, "choices": {"x": {"choice": "gpu", "ms": {}}}}),
        json.dumps({"format": 99, "choices": {}}),
        b"\xff\xfe\x00",
    ],
    ids=["bad-json", "a-list", "unknown-choice", "other-format", "not-utf8"],
)
def test_a_corrupt_cache_is_measured_over_with_a_warning(
    cache_dir: Path, logs: list[dict], damage: str | bytes
) -> None:
    cache_dir.mkdir()
    path = cache_dir / "linear_choice.json"
    path.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    timer = RecordingTimer(WINNERS)
    choice = linear_choice.choose(WINNERS, torch.float32, "cpu-a", timer)
    assert len(timer.calls) == 3 and choice.measured and choice.shapes == WINNERS
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1 and "linear choice cache" in warnings[0]["event"]
    assert warnings[0]["path"] == str(path)
    stored = json.loads(path.read_text())  # overwritten with a good file
    assert stored["format"] == 1 and len(stored["choices"]) == 3
    assert [p.name for p in cache_dir.iterdir()] == ["linear_choice.json"]  # no temporary file left


def test_an_unwritable_cache_directory_only_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: list[dict]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("POWERTRAIN_CACHE_DIR", str(blocker / "cache"))  # under a file: mkdir fails, even as root
    model = small_model(fresh_seed())
    assert pack_for_platform(model, CPU, torch.float32, timer=RecordingTimer(WINNERS)) == 2
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["event"] == "linear choice cache not written; measuring again next time"
    assert [entry["event"] for entry in logs if entry["log_level"] == "info"] == [CHOSEN]


def test_keys_differ_by_what_the_timing_depends_on(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ("cpu-a", "2.9.0", 2, torch.float32, (48, 32))
    keys = {
        cache_key(*base),
        cache_key("cpu-b", *base[1:]),
        cache_key(base[0], "2.10.0", *base[2:]),
        cache_key(*base[:2], 4, *base[3:]),
        cache_key(*base[:3], torch.bfloat16, base[4]),
        cache_key(*base[:4], (32, 48)),
    }
    assert len(keys) == 6

    # and a cached choice is not reused across them: another CPU or torch times again
    linear_choice.choose([(48, 32)], torch.float32, "cpu-a", RecordingTimer(WINNERS))
    for cpu, version in [("cpu-b", torch.__version__), ("cpu-a", "0.0.0-other")]:
        monkeypatch.setattr(torch, "__version__", version)
        timer = RecordingTimer(WINNERS)
        linear_choice.choose([(48, 32)], torch.float32, cpu, timer)
        assert timer.calls == [((48, 32), torch.float32)], (cpu, version)


def test_cache_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POWERTRAIN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "explicit" / "linear_choice.json"
    monkeypatch.delenv("POWERTRAIN_CACHE_DIR")
    assert cache_path() == tmp_path / "xdg" / "powertrain" / "linear_choice.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path() == tmp_path / "home" / ".cache" / "powertrain" / "linear_choice.json"


def test_the_real_timer_chooses_for_every_shape(cache_dir: Path) -> None:
    shapes = [(48, 32), (80, 32), (2500, 16)]  # the last is drawn from repeated random rows
    choice = linear_choice.choose(shapes, torch.float32, CPU.device_name)
    assert choice.measured and set(choice.shapes) == set(shapes)
    assert all(candidate in (PLAIN, PACKED) for candidate in choice.shapes.values())
    for times in choice.ms.values():
        assert all(times[c][row] > 0 for c in (PLAIN, PACKED) for row in ROW_CLASSES)
    weight = linear_choice.throwaway_weight((2500, 16), torch.float32)
    assert weight.shape == (2500, 16) and weight.is_contiguous() and weight.std() > 0
