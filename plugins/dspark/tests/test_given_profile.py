"""``[dspark] steps_per_second``: a profile given in the config instead of measured at startup.

The policy is built as the engine builds it (``plugin.build``); the target model is never
run, so the context carries no model and a probe that fails if it is called.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from powertrain.interfaces import SpeculativeContext
from powertrain_dspark.lengths import StepsPerSecondGrid
from powertrain_dspark.plugin import DSparkConfig, build


def never_measure(*_: Any) -> dict:
    raise AssertionError("the startup probe ran although the config gives the profile")


def context(config: DSparkConfig) -> SpeculativeContext:
    return SpeculativeContext(
        config=config,
        model=None,  # type: ignore[arg-type]  # the n-gram drafter never reads it
        vocab_size=100,
        device=torch.device("cpu"),
        block_size=16,
        measure_steps_per_second=never_measure,
        allocate_kv_caches=None,  # type: ignore[arg-type]
    )


def test_a_given_profile_is_used_and_nothing_is_measured() -> None:
    rng = random.Random()
    table = [[n, q, rng.uniform(5.0, 50.0)] for n in (1, 4, 16) for q in range(1, 4)]
    decoder = build(context(DSparkConfig(max_draft_tokens=2, steps_per_second=table)), "dspark")
    want = StepsPerSecondGrid.from_profile({(n, q): sps for n, q, sps in table})
    assert decoder.sps == want
    for n in (1, 3, 16):
        for tokens in (n, 2 * n, 3 * n):
            assert decoder.sps.for_sequences(n)(tokens) == pytest.approx(want.for_sequences(n)(tokens))


def test_fixed_k_ignores_the_profile() -> None:
    decoder = build(context(DSparkConfig(steps_per_second=[[1, 1, 10.0]])), "fixed")
    assert decoder.sps is None


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ([[1, 1]], r"steps_per_second takes \[sequences, tokens, steps/s\] triples of numbers; got \[1, 1\]"),
        ([5.0], r"steps_per_second takes \[sequences, tokens, steps/s\] triples of numbers; got 5.0"),
        ([[1, "two", 3.0]], r"steps_per_second takes .* triples of numbers; got \[1, 'two', 3.0\]"),
        ([[1, q, 10.0] for q in (1, 2)], r"no entry with \[3\] tokens per sequence; max_draft_tokens=2 needs 1 to 3"),
        ([[1, q, 10.0] for q in (1, 2, 3)] + [[4, 1, 5.0]], r"steps_per_second: .*missing \[\(4, 2\), \(4, 3\)\]"),
        ([[1, q, 10.0 - 5 * q] for q in (1, 2, 3)], r"steps_per_second: .*needs positive rates"),
    ],
    ids=["pair", "number", "not-a-number", "missing-width", "incomplete-grid", "non-positive"],
)
def test_a_bad_profile_is_refused_naming_the_option(table: list, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        build(context(DSparkConfig(max_draft_tokens=2, steps_per_second=table)), "dspark")
