"""Speculative sampling reproduces the target's distribution (chi-square, seeded runs).

The target here is a tiny model whose next-token distribution is an exact function of
the prefix (a random table over a 3-token vocabulary), so the law of the first three
generated tokens is known exactly (27 outcomes). Thousands of requests run through the
real pieces — ``SpeculativeDecoder`` with the DSpark, lagged-budget and fixed-k length
rules and the rejection-sampling verifier — in batches, so DSpark's ranking mixes
requests. The drafter is stochastic (drafts sampled from its own distribution) and,
in one case, its confidence for position 2 depends on the token it drafted at
position 1. A control whose length rule looks at the draft itself must fail the same
test, which shows the test can tell.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from powertrain.engine.speculative import grammar_cut
from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.speculative import DraftSlot, VerifyBatch
from powertrain_dspark.drafter import DraftBatch
from powertrain_dspark.lengths import StepsPerSecond
from powertrain_dspark.policy import SpeculativeDecoder

VOCAB = 3
GENERATED = 3
SIGNIFICANCE = 1e-3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every tensor here is a few entries wide, yet ATen's softmax still hands its rows to
    the thread pool: on a 2-core machine the handoff costs ~10x the arithmetic (about 1 ms
    a call when the machine is busy), most of these tests' time. One thread computes the
    same values (the draws come from the requests' own generators either way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ExactTarget:
    """p(next | prefix) from a seeded random table: distributions computable exactly."""

    def __init__(self, seed: int, sharpness: float = 1.5) -> None:
        self.seed, self.sharpness = seed, sharpness
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._cache:
            g = torch.Generator().manual_seed(hash((self.seed, prefix)) % 2**31)
            self._cache[prefix] = torch.randn(VOCAB, generator=g, dtype=torch.float64).float() * self.sharpness
        return self._cache[prefix]

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return torch.softmax(self.logits(prefix).double(), dim=-1)


class StochasticDrafter:
    """Drafts from another table (a perturbed target); confidences from the prefix only.

    ``position2_depends_on_draft1``: c(2) is high when draft 1 was token 0, low otherwise.
    """

    def __init__(
        self, target: ExactTarget, depth: int, position2_depends_on_draft1: bool, deterministic: bool = False
    ) -> None:
        self.table = ExactTarget(seed=target.seed + 7, sharpness=1.0)
        self.target = target
        self.depth = depth
        self.dependent = position2_depends_on_draft1
        self.deterministic = deterministic  # draft q's argmax: a point mass, as the n-gram drafter

    def propose(self, slots):
        drafts, confidences, probs = [], [], []
        for slot in slots:
            prefix = tuple(slot.token_ids)
            tokens, conf, dists = [], [], []
            for k in range(min(self.depth, slot.max_draft)):
                q = torch.softmax(self.table.logits(prefix) + self.target.logits(prefix), dim=-1)
                if k == 0:
                    c = 0.8
                elif k == 1 and self.dependent:
                    c = 0.9 if tokens[0] == 0 else 0.15  # depends on draft 1, not on draft 2
                else:
                    c = 0.5
                if self.deterministic:
                    token = int(q.argmax())
                else:
                    token = int(torch.multinomial(q, 1, generator=slot.generator))
                tokens.append(token)
                conf.append(c)
                dists.append(q)
                prefix = (*prefix, token)
            drafts.append(tokens)
            confidences.append(conf)
            probs.append(torch.stack(dists) if dists and not self.deterministic else None)
        return DraftBatch(tokens=drafts, confidences=confidences, draft_probs=probs)

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        pass


class PeekingRule(SpeculativeDecoder):
    """The control: verifies draft 1 only when it is token 0 — a choice that looks at the
    draft it is choosing whether to test, which biases the output."""

    def choose_lengths(self, drafting, rows, batch):
        return [1 if tokens and tokens[0] == 0 else 0 for tokens in drafting.session.drafts().tokens]


def forbidden(prefix: tuple[int, ...]) -> int | None:
    """A grammar over the 3-token vocabulary: no token may repeat the one before it."""
    return prefix[-1]


def _masked(logits: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """The sampler's view of a constrained row: the forbidden token's logit at -inf."""
    masked = logits.clone()
    masked[forbidden(prefix)] = float("-inf")
    return masked


def _exact_law(target: ExactTarget, prompt: tuple[int, ...], constrained: bool = False) -> dict[tuple[int, ...], float]:
    law = {}
    for outcome in itertools.product(range(VOCAB), repeat=GENERATED):
        p, prefix = 1.0, prompt
        for token in outcome:
            logits = _masked(target.logits(prefix), prefix) if constrained else target.logits(prefix)
            p *= float(torch.softmax(logits.double(), dim=-1)[token])
            prefix = (*prefix, token)
        if p > 0:
            law[outcome] = p
    return law


def _allowed(prefix: tuple[int, ...], drafts: list[int]) -> int:
    """How many of ``drafts``, from the start, the grammar allows after ``prefix``."""
    for count, token in enumerate(drafts):
        if token == forbidden((*prefix, *drafts[:count])):
            return count
    return len(drafts)


def _run(
    policy: SpeculativeDecoder,
    target: ExactTarget,
    prompt: tuple[int, ...],
    runs: int,
    batch: int,
    cut: Callable[[int, int, bool], int] | None = None,
) -> tuple[dict, set[int]]:
    """Generate ``GENERATED`` tokens for ``runs`` seeded requests, ``batch`` at a time,
    the way the engine does: propose, choose lengths, verify, keep. With ``cut`` the
    requests are constrained by ``forbidden``, as the engine constrains them: lengths cut
    by the grammar, the rows up to the last allowed draft masked. Returns the counts of
    the outcomes and the set of lengths the rule chose."""
    chosen: set[int] = set()
    params = SamplingParams(temperature=1.0, max_tokens=GENERATED)
    counts: dict[tuple[int, ...], int] = {}
    seq_ids = itertools.count()
    for first in range(0, runs, batch):
        live = {}
        for i in range(first, min(first + batch, runs)):
            live[next(seq_ids)] = (list(prompt), torch.Generator().manual_seed(10_000 + i))
        while live:
            slots = [
                DraftSlot(
                    seq_id=seq_id,
                    token_ids=tokens,
                    num_prompt_tokens=len(prompt),
                    params=params,
                    generator=generator,
                    max_draft=len(prompt) + GENERATED - len(tokens) - 1,
                )
                for seq_id, (tokens, generator) in live.items()
            ]
            proposal = policy.propose(slots, VerifyBatch(base_tokens=len(slots), num_sampling=len(slots)))
            lengths = list(proposal.lengths)
            chosen.update(lengths)
            logits, plain = [], []
            for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
                prefix, drafts = tuple(slot.token_ids), proposal.tokens[i]
                allowed = _allowed(prefix, drafts[:n]) if cut else n
                if cut:
                    lengths[i] = n = cut(n, allowed, proposal.draft_probs[i] is not None)
                rows = [target.logits(prefix + tuple(drafts[:j])) for j in range(n + 1)]
                if cut:
                    rows = [_masked(r, prefix + tuple(drafts[:j])) if j <= allowed else r for j, r in enumerate(rows)]
                (logits if n else plain).append(torch.stack(rows))
            kept = iter(policy.verify(proposal, lengths, logits))
            for slot, n in zip(slots, lengths, strict=True):
                tokens, generator = live[slot.seq_id]
                if n:
                    new = next(kept)
                else:  # no drafts: the engine's sampler draws from the target
                    prefix = tuple(tokens)
                    row = _masked(target.logits(prefix), prefix) if cut else target.logits(prefix)
                    new = [int(torch.multinomial(torch.softmax(row.double(), -1).float(), 1, generator=generator))]
                tokens.extend(new)
                if len(tokens) - len(prompt) >= GENERATED:
                    outcome = tuple(tokens[len(prompt) : len(prompt) + GENERATED])
                    counts[outcome] = counts.get(outcome, 0) + 1
                    del live[slot.seq_id]
    return counts, chosen


def _chi_square_p(counts: dict, law: dict, runs: int) -> float:
    statistic = sum((counts.get(o, 0) - runs * p) ** 2 / (runs * p) for o, p in law.items())
    dof = len(law) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def _policy(rule: str, drafter: StochasticDrafter, lagged: bool = False, cls=SpeculativeDecoder):
    # Step time 1 + 0.02·B: a draft of survival a is admitted while a·t(B) > τ·0.02, so
    # at this batch size DSpark admits some drafts and not others, by their confidences.
    sps = StepsPerSecond.from_profile({b: 1 / (1 + 0.02 * b) for b in (1, 16, 32, 64)})
    return cls(drafter, rule, sps=sps, fixed_k=3, lagged_budget=lagged)


@pytest.mark.parametrize(
    ("rule", "lagged", "dependent", "deterministic"),
    [
        ("dspark", False, True, False),
        ("dspark", False, False, False),
        ("dspark", True, True, False),
        ("fixed", False, True, False),
        ("dspark", False, True, True),
    ],
    ids=["dspark-c2-depends-on-d1", "dspark", "dspark-lagged-budget", "fixed-k", "dspark-point-mass-drafts"],
)
def test_speculative_sampling_matches_the_target_distribution(
    rule: str, lagged: bool, dependent: bool, deterministic: bool
) -> None:
    target = ExactTarget(seed=3)
    prompt = (1, 2)
    drafter = StochasticDrafter(target, depth=3, position2_depends_on_draft1=dependent, deterministic=deterministic)
    policy = _policy(rule, drafter, lagged)
    runs = 4000
    counts, chosen = _run(policy, target, prompt, runs, batch=16)
    assert sum(counts.values()) == runs
    if rule == "dspark":  # the run only means something if the choice varies
        assert ({0, 1} if deterministic else {0, 1, 2}) <= chosen, chosen
    p_value = _chi_square_p(counts, _exact_law(target, prompt), runs)
    assert p_value > SIGNIFICANCE, f"output law differs from the target's: chi-square p = {p_value:.2e}"


def test_a_length_rule_that_peeks_at_the_draft_is_caught() -> None:
    target = ExactTarget(seed=3)
    prompt = (1, 2)
    policy = _policy("dspark", StochasticDrafter(target, depth=3, position2_depends_on_draft1=False), cls=PeekingRule)
    runs = 4000
    counts, _ = _run(policy, target, prompt, runs, batch=16)
    p_value = _chi_square_p(counts, _exact_law(target, prompt), runs)
    assert p_value < SIGNIFICANCE, f"the biased control passed (p = {p_value:.2e}): the test has no power"


@pytest.mark.parametrize("deterministic", [False, True], ids=["stochastic-drafts", "point-mass-drafts"])
def test_constrained_speculation_matches_the_masked_target_distribution(deterministic: bool) -> None:
    """Under a grammar the engine cuts drafts where the grammar first forbids one
    (``grammar_cut``) and masks the verified rows; the output must follow the masked
    target exactly."""
    target = ExactTarget(seed=3)
    prompt = (1, 2)
    drafter = StochasticDrafter(target, depth=3, position2_depends_on_draft1=True, deterministic=deterministic)
    runs = 4000
    counts, _ = _run(_policy("fixed", drafter), target, prompt, runs, batch=16, cut=grammar_cut)
    assert sum(counts.values()) == runs
    p_value = _chi_square_p(counts, _exact_law(target, prompt, constrained=True), runs)
    assert p_value > SIGNIFICANCE, f"output law differs from the masked target's: chi-square p = {p_value:.2e}"


def test_cutting_a_stochastic_draft_before_the_forbidden_one_is_caught() -> None:
    """The control: cutting stochastic drafts before the first forbidden one, as is exact
    for point masses, draws the next token from the target instead of the residual."""
    target = ExactTarget(seed=3)
    prompt = (1, 2)
    drafter = StochasticDrafter(target, depth=3, position2_depends_on_draft1=True)
    runs = 4000

    def cut_before(length: int, allowed: int, stochastic: bool) -> int:
        return grammar_cut(length, allowed, stochastic=False)

    counts, _ = _run(_policy("fixed", drafter), target, prompt, runs, batch=16, cut=cut_before)
    p_value = _chi_square_p(counts, _exact_law(target, prompt, constrained=True), runs)
    assert p_value < SIGNIFICANCE, f"the biased control passed (p = {p_value:.2e}): the test has no power"
