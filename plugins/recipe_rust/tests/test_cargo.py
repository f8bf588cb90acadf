"""The Rust crate's own tests (golden prompts and ids, protocol tables, proptests), run
from the one test command so CI cannot skip them."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
def test_cargo_test_passes(cargo_test) -> None:
    cargo_test(Path(__file__).resolve().parents[1], "powertrain-recipe")
