"""The Rust crate's own tests (the thread pool: every chunk once, parked workers woken,
concurrent callers, panics), run from the one test command so CI cannot skip them."""

from __future__ import annotations

from pathlib import Path


def test_cargo_test_passes(cargo_test) -> None:
    cargo_test(Path(__file__).resolve().parents[1], "powertrain-cpu-kernels")
