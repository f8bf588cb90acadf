"""DSpark's choice of verification lengths, checked against a brute-force search of the
same greedy rule and against the properties the issue asks for."""

from __future__ import annotations

import random

import pytest

from powertrain_dspark.lengths import (
    StepsPerSecond,
    StepsPerSecondGrid,
    dspark_lengths,
    dspark_rule,
    fixed_lengths,
    fixed_rule,
    survival,
    top_k_lengths,
    top_k_rule,
)


def linear_profile(fixed: float, per_token: float) -> StepsPerSecond:
    return StepsPerSecond.from_profile({b: 1 / (fixed + per_token * b) for b in (1, 8, 64, 512)})


def reference_greedy(confidences, sps, base_tokens, base_yield):
    """The rule written out plainly: rank (r, j) by a(r, j), admit while τ·SPS(B) rises."""
    alive = survival(confidences)
    ranked = sorted(
        ((a, r, j) for r, row in enumerate(alive) for j, a in enumerate(row, 1)), key=lambda t: (-t[0], t[2], t[1])
    )
    lengths, batch, tokens = [0] * len(confidences), base_tokens, base_yield
    for a, r, j in ranked:
        if (tokens + a) * sps(batch + 1) <= tokens * sps(batch):
            break
        lengths[r], batch, tokens = j, batch + 1, tokens + a
    return lengths


def test_steps_per_second_interpolates_step_time() -> None:
    sps = StepsPerSecond.from_profile({1: 100.0, 11: 50.0})
    assert sps(1) == pytest.approx(100.0)
    assert sps(6) == pytest.approx(1 / 0.015)  # halfway in time, not in rate
    assert sps(21) == pytest.approx(1 / 0.03)  # extrapolated from the last two points
    with pytest.raises(ValueError, match="positive"):
        StepsPerSecond.from_profile({1: 0.0})


def test_grid_gives_the_curve_of_the_step_sequence_count() -> None:
    # step time = 10 ms per sequence + 1 ms per token: what a 1-D SPS(B) cannot express
    grid = StepsPerSecondGrid.from_profile(
        {(n, q): 1 / (0.01 * n + 0.001 * n * q) for n in (1, 4, 16) for q in (1, 2, 3)}
    )
    for n in (1, 4, 16):  # exact at profiled counts, at B = n·q
        curve = grid.for_sequences(n)
        for q in (1, 2, 3):
            assert 1 / curve(n * q) == pytest.approx(0.01 * n + 0.001 * n * q)
    curve = grid.for_sequences(10)  # halfway between 4 and 16 sequences: halfway in time
    assert 1 / curve(20) == pytest.approx(0.1 + 0.02)
    curve = grid.for_sequences(28)  # beyond the last count: extrapolated from the last two
    assert 1 / curve(56) == pytest.approx(0.28 + 0.056)
    with pytest.raises(ValueError, match="missing"):
        StepsPerSecondGrid.from_profile({(1, 1): 1.0, (1, 2): 1.0, (4, 1): 1.0})


def test_survival_is_the_running_product() -> None:
    assert survival([[0.5, 0.5, 1.0], []]) == [[0.5, 0.25, 0.25], []]


@pytest.mark.parametrize("seed", range(20))
def test_dspark_lengths_follow_the_greedy_rule(seed: int) -> None:
    rng = random.Random(seed)
    confidences = [[rng.random() ** 0.3 for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(1, 40))]
    sps = linear_profile(1.0, rng.uniform(0.001, 0.1))
    base = len(confidences) + rng.randint(0, 50)
    expected = reference_greedy(confidences, sps, base, len(confidences))
    assert dspark_lengths(confidences, sps, base, len(confidences)) == expected


def test_an_admission_that_does_not_pay_ends_the_choice() -> None:
    """Request 0's second draft is worth it only if its first is; the rule must not skip
    past a non-paying candidate to a later, better-paying one."""
    sps = linear_profile(1.0, 0.5)  # each token costs half a fixed step
    lengths = dspark_lengths([[0.3, 0.3], [0.99]], sps, base_tokens=2, base_yield=2)
    assert lengths == [0, 1]


def test_the_budget_shrinks_as_concurrency_grows() -> None:
    sps = linear_profile(1.0, 0.02)
    rng = random.Random(0)
    per_request = []
    for concurrency in (1, 4, 16, 64):
        confidences = [[0.9 * rng.uniform(0.7, 1.0)] * 5 for _ in range(concurrency)]
        lengths = dspark_lengths(confidences, sps, concurrency, concurrency)
        per_request.append(sum(lengths) / concurrency)
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] > per_request[-1]


def test_top_k_lengths_take_the_best_candidates_as_prefixes() -> None:
    confidences = [[0.9, 0.9], [0.5], [0.95, 0.1]]
    assert top_k_lengths(confidences, 3) == [2, 0, 1]  # 0.95, 0.9, 0.81
    assert top_k_lengths(confidences, 0) == [0, 0, 0]
    assert top_k_lengths(confidences, 99) == [2, 1, 2]


def test_fixed_lengths() -> None:
    assert fixed_lengths([5, 2, 0], 3) == [3, 2, 0]


class OnDemand:
    """A ``Drafting`` over known confidences that enforces the order a drafter imposes: the
    confidence of draft j is readable only once draft j-1 is drawn. Records every draw."""

    def __init__(self, confidences: list[list[float]]) -> None:
        self.confidences = confidences
        self.drawn = [0] * len(confidences)
        self.draws: list[tuple[int, int]] = []

    def confidence(self, row: int, position: int) -> float | None:
        assert position <= self.drawn[row] + 1, f"row {row}: confidence {position} read before draft {position - 1}"
        known = self.confidences[row]
        return known[position - 1] if position <= len(known) else None

    def draw(self, wanted) -> None:
        for row, position in wanted:
            assert position == self.drawn[row] + 1, f"row {row}: draft {position} drawn out of order"
            assert position <= len(self.confidences[row])
            self.drawn[row] = position
            self.draws.append((row, position))


def random_confidences(rng: random.Random) -> list[list[float]]:
    """Rows of random confidences, coarse enough for survival ties across rows and positions."""
    return [[round(rng.random() ** 0.3, 1) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("seed", range(30))
def test_drawing_on_demand_admits_what_full_drafts_would_and_draws_only_those(seed: int) -> None:
    """The rules walk candidates drawing a row's next draft only when needed: the lengths
    equal the plain ranking over fully drawn drafts (``reference_greedy``, and the top-k
    ranking for the lagged budget), and every draft drawn is one that is verified."""
    rng = random.Random(seed)
    confidences = random_confidences(rng)
    sps = linear_profile(1.0, rng.uniform(0.001, 0.1))
    base = len(confidences) + rng.randint(0, 50)
    source = OnDemand(confidences)
    lengths = dspark_rule(source, len(confidences), sps, base, len(confidences))
    assert lengths == reference_greedy(confidences, sps, base, len(confidences))
    assert source.drawn == lengths
    budget = rng.randint(0, 30)
    source = OnDemand(confidences)
    lengths = top_k_rule(source, len(confidences), budget)
    assert lengths == top_k_lengths(confidences, budget)
    assert source.drawn == lengths
    source = OnDemand(confidences)
    assert fixed_rule(source, len(confidences), 3) == fixed_lengths([len(c) for c in confidences], 3)
    assert source.drawn == fixed_lengths([len(c) for c in confidences], 3)


def test_drawing_on_demand_keeps_the_tie_order() -> None:
    """A row whose admitted draft is undrawn may tie the best known candidate: its next
    draft is drawn first, so ties still go to the earlier position, then the lower row."""
    confidences = [[0.5, 1.0], [1.0, 0.5]]  # (1.0, r1, j1), then 0.5 for (r0, j1), (r0, j2), (r1, j2)
    assert top_k_lengths(confidences, 3) == [2, 1]
    source = OnDemand(confidences)
    assert top_k_rule(source, 2, 3) == [2, 1]
