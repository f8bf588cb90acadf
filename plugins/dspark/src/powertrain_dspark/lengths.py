"""How many drafts of each request to verify: DSpark's choice, its lagged variant, fixed-k.

DSpark. Draft j of request r survives verification with probability
a(r, j) = c(r, 1)·…·c(r, j). Verifying ℓ(r) drafts of each request makes a batch of
B = base + Σ ℓ(r) tokens that is expected to yield τ = base_yield + Σ_j≤ℓ(r) a(r, j)
tokens, at SPS(B) target steps per second. Candidates (r, j) are admitted in order of
a(r, j), highest first, while τ·SPS(B) keeps rising, and the first admission that
does not raise it ends the choice.

Why that early stop keeps verification lossless: whether draft j of r is verified
must not depend on draft j itself (rejection sampling of a stochastic draft is only
exact when the decision to test it was taken without looking at it). c(r, j) may
depend on drafts 1..j-1 of r but not on draft j, so a(r, j') for j' > j — which
does depend on draft j — must not influence whether (r, j) is admitted. Survival
never grows along a request (a(r, j+1) ≤ a(r, j); ties go to the earlier position),
so every candidate of r after j comes later in the order, and with the early stop
nothing that comes later can change an earlier admission. A global optimum over all
subsets would: verifying j could pay off only because j+1 looks good.

Lagged budget (the async variant). An overlapped engine must fix the step's size K
(how many drafts to verify in all) before the current drafts exist; it uses K from
the previous step's confidences, and the current ones only rank: the K candidates of
highest current survival are admitted. The causal property holds for the same
reason: whether (r, j) is among the top K depends on its rank, i.e. on candidates
with survival ≥ a(r, j), none of which is a later position of r; K itself comes from
a finished step.

Drawing drafts on demand. A candidate's confidence c(r, j) needs only drafts 1..j-1 of r,
so the rules here walk the candidates in that order over a ``Drafting`` (``_Walk``) and
draw draft j of r only once (r, j) is admitted, or once a later candidate of r could
come before the best one known: a drafter whose drafts are dear (the block drafter's
vocabulary projections) pays for the drafts verified, not for a whole block. The walk
admits exactly what ranking every candidate of fully drawn drafts would: a row's next
candidate is drawn whenever its survival bound (the survival of its last admitted
draft) reaches the best known candidate's.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs


@attrs.frozen
class StepsPerSecond:
    """SPS(B) from a startup profile: step time is interpolated linearly in B between
    measured points (and extrapolated from the last two beyond them)."""

    batch_tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def from_profile(cls, profile: Mapping[int, float]) -> StepsPerSecond:
        if not profile or any(v <= 0 for v in profile.values()):
            raise ValueError(f"a steps-per-second profile needs positive rates, got {dict(profile)}")
        points = sorted(profile.items())
        return cls(tuple(b for b, _ in points), tuple(1.0 / sps for _, sps in points))

    def __call__(self, batch_tokens: float) -> float:
        xs, ys = self.batch_tokens, self.seconds
        if len(xs) == 1:
            return 1.0 / (ys[0] * max(batch_tokens, 1) / xs[0])
        i = min(max(bisect.bisect_left(xs, batch_tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        seconds = y0 + (y1 - y0) * (batch_tokens - x0) / (x1 - x0)
        return 1.0 / max(seconds, ys[0] * 1e-3)


@attrs.frozen
class StepsPerSecondGrid:
    """SPS as a function of the batch token count B *at the step's sequence count*.

    Measured at startup for sequence counts ``n`` and tokens per sequence ``q`` (a token
    and q - 1 drafts). For each profiled ``n`` the step time is fitted by least squares
    with a line in B (intercept: the per-step and per-sequence cost; slope: the cost of
    one more token), and ``for_sequences(n)`` interpolates both linearly in ``n``
    between the two nearest profiled counts (extrapolating beyond them).

    Why the sequence count: a one-dimensional SPS(B) probed with a fixed q conflated B
    with it, pricing 16 one-token sequences at 35 ms where they take 55 ms, so every
    draft looked dear. Why a fitted line rather than the raw points: DSpark stops at
    the first admission that does not pay, so a single noisy point (one probe 30 ms
    slow) ended the choice there; measured step times at a fixed n were linear in B
    up to that noise.
    """

    seconds: Mapping[tuple[int, int], float]
    #: ``(intercept, seconds per token)`` fitted at each profiled count (``line``), once.
    lines: Mapping[int, tuple[float, float]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        counts = sorted({n for n, _ in self.seconds})
        object.__setattr__(self, "lines", {n: self.line(n) for n in counts})

    @classmethod
    def from_profile(cls, profile: Mapping[tuple[int, int], float]) -> StepsPerSecondGrid:
        if not profile or any(v <= 0 for v in profile.values()):
            raise ValueError(f"a steps-per-second profile needs positive rates, got {dict(profile)}")
        counts = sorted({n for n, _ in profile})
        widths = sorted({q for _, q in profile})
        missing = [(n, q) for n in counts for q in widths if (n, q) not in profile]
        if missing:
            raise ValueError(f"a steps-per-second grid needs every (sequences, tokens) pair; missing {missing}")
        return cls({key: 1.0 / sps for key, sps in profile.items()})

    def line(self, n: int) -> tuple[float, float]:
        """``(intercept, seconds per token)`` of the step time fitted at profiled count ``n``."""
        points = [(n * q, t) for (count, q), t in self.seconds.items() if count == n]
        if len(points) == 1:
            return 0.0, points[0][1] / points[0][0]
        mean_b = sum(b for b, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(sum((b - mean_b) * (t - mean_t) for b, t in points) / spread, 0.0)
        return mean_t - slope * mean_b, slope

    def for_sequences(self, num_seqs: int) -> StepsPerSecond:
        counts = list(self.lines)
        n = max(num_seqs, 1)
        if len(counts) == 1:
            intercept, slope = self.lines[counts[0]]
        else:
            i = min(max(bisect.bisect_left(counts, n), 1), len(counts) - 1)
            lo, hi = counts[i - 1], counts[i]
            (a_lo, g_lo), (a_hi, g_hi) = self.lines[lo], self.lines[hi]
            share = (n - lo) / (hi - lo)
            intercept, slope = a_lo + (a_hi - a_lo) * share, max(g_lo + (g_hi - g_lo) * share, 0.0)
        floor = min(self.seconds.values())  # a step never takes less than the fastest probe
        widest = max(q for _, q in self.seconds)
        return StepsPerSecond.from_profile({b: 1.0 / max(intercept + slope * b, floor) for b in (n, n * widest + 1)})


class Drafting(Protocol):
    """Drafts drawn on demand, position by position (``drafter.DraftSession``, its
    confidences calibrated)."""

    def confidence(self, row: int, position: int) -> float | None:
        """c(row, position), drafts 1..position-1 of ``row`` drawn; None: no draft there."""
        ...

    def draw(self, wanted: Sequence[tuple[int, int]]) -> None:
        """Draw draft ``position`` of ``row`` for each pair (the drafts before it drawn)."""
        ...


@attrs.frozen
class _Known:
    """Confidences of drafts drawn in full: a ``Drafting`` with nothing left to draw."""

    confidences: Sequence[Sequence[float]]

    def confidence(self, row: int, position: int) -> float | None:
        known = self.confidences[row]
        return float(known[position - 1]) if position <= len(known) else None

    def draw(self, wanted: Sequence[tuple[int, int]]) -> None:
        """Drawn already."""


class _Walk:
    """The candidates (a, r, j) in DSpark's order (survival highest first; ties: earlier
    position, then row) over a ``Drafting``, drawing a row's next draft only when its next
    candidate could come before the best known one (module doc)."""

    def __init__(self, drafting: Drafting, rows: int) -> None:
        self.drafting = drafting
        self.lengths = [0] * rows
        self.alive = [1.0] * rows  # survival of each row's admitted drafts
        self.known: list[tuple[float, int, int]] = []  # heap of (-a, j, r)
        self.undrawn: dict[int, float] = {}  # row -> survival of its admitted, undrawn draft
        for row in range(rows):
            self._push(row)

    def _push(self, row: int) -> None:
        position = self.lengths[row] + 1
        c = self.drafting.confidence(row, position)
        if c is not None:
            heapq.heappush(self.known, (-(self.alive[row] * min(max(float(c), 0.0), 1.0)), position, row))

    def best(self) -> tuple[float, int, int] | None:
        """The next candidate (a, r, j) in order, or None when none is left."""
        while self.undrawn and (not self.known or max(self.undrawn.values()) >= -self.known[0][0]):
            rows = sorted(self.undrawn)
            self.undrawn.clear()
            self.drafting.draw([(row, self.lengths[row]) for row in rows])
            for row in rows:
                self._push(row)
        if not self.known:
            return None
        negative, position, row = self.known[0]
        return -negative, row, position

    def admit(self) -> None:
        """Admit the candidate ``best`` returned."""
        negative, position, row = heapq.heappop(self.known)
        assert position == self.lengths[row] + 1, "survival must not grow along a request"
        self.lengths[row], self.alive[row] = position, -negative
        self.undrawn[row] = -negative

    def finish(self) -> list[int]:
        """The lengths admitted, every admitted draft drawn."""
        if self.undrawn:
            self.drafting.draw([(row, self.lengths[row]) for row in sorted(self.undrawn)])
            self.undrawn.clear()
        return self.lengths


def survival(confidences: Sequence[Sequence[float]]) -> list[list[float]]:
    """a(r, j) = c(r, 1)·…·c(r, j) for each request."""
    result = []
    for row in confidences:
        product, out = 1.0, []
        for c in row:
            product *= min(max(float(c), 0.0), 1.0)
            out.append(product)
        result.append(out)
    return result


def dspark_rule(
    drafting: Drafting, rows: int, sps: Callable[[float], float], base_tokens: int, base_yield: float
) -> list[int]:
    """DSpark's choice (module doc): admit by survival while expected tokens per second rises."""
    walk = _Walk(drafting, rows)
    batch, tokens = base_tokens, base_yield
    rate = tokens * sps(batch)
    while (candidate := walk.best()) is not None:
        a = candidate[0]
        new_rate = (tokens + a) * sps(batch + 1)
        if new_rate <= rate:
            break
        walk.admit()
        batch, tokens, rate = batch + 1, tokens + a, new_rate
    return walk.finish()


def top_k_rule(drafting: Drafting, rows: int, budget: int) -> list[int]:
    """Admit the ``budget`` candidates of highest survival (the lagged variant's ranking)."""
    walk = _Walk(drafting, rows)
    for _ in range(max(budget, 0)):
        if walk.best() is None:
            break
        walk.admit()
    return walk.finish()


def fixed_rule(drafting: Drafting, rows: int, k: int) -> list[int]:
    """Verify ``k`` drafts of every request (fewer where fewer can be drafted)."""
    lengths = [0] * rows
    for position in range(1, k + 1):
        wanted = [(row, position) for row in range(rows) if lengths[row] == position - 1]
        wanted = [(row, j) for row, j in wanted if drafting.confidence(row, j) is not None]
        if not wanted:
            break
        drafting.draw(wanted)
        for row, _ in wanted:
            lengths[row] = position
    return lengths


def dspark_lengths(
    confidences: Sequence[Sequence[float]], sps: Callable[[float], float], base_tokens: int, base_yield: float
) -> list[int]:
    """``dspark_rule`` over drafts drawn in full."""
    return dspark_rule(_Known(confidences), len(confidences), sps, base_tokens, base_yield)


def top_k_lengths(confidences: Sequence[Sequence[float]], budget: int) -> list[int]:
    """``top_k_rule`` over drafts drawn in full."""
    return top_k_rule(_Known(confidences), len(confidences), budget)


def fixed_lengths(drafted: Sequence[int], k: int) -> list[int]:
    """Verify ``k`` drafts of every request (fewer where fewer were drafted)."""
    return [min(n, k) for n in drafted]
