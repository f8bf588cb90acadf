"""The law of a request's first tokens and Pearson's test against it: how speculative
decoding's tests show that the engine still samples from the target's distribution."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from powertrain.interfaces.sampling import SamplingParams, target_probs

#: A correct engine fails a test at this level once in a thousand fresh runs.
SIGNIFICANCE = 1e-3


def exact_law(
    next_logits: Callable[[list[int]], torch.Tensor], prompt: Sequence[int], params: SamplingParams, generated: int
) -> dict[tuple[int, ...], float]:
    """The probability of every ``generated``-token outcome after ``prompt`` when each token is
    drawn from ``target_probs`` of ``next_logits(tokens so far)`` under ``params``: one call per
    prefix of nonzero probability (so keep the law small, e.g. with top-k)."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(generated):
        grown = {}
        for outcome, p in law.items():
            probs = target_probs(next_logits([*prompt, *outcome])[None], params)[0].double()
            for token in probs.nonzero().flatten().tolist():
                grown[(*outcome, token)] = p * float(probs[token])
        law = grown
    return law


def chi_square_p(counts: Mapping[tuple[int, ...], int], law: Mapping[tuple[int, ...], float], runs: int) -> float:
    """Pearson's test of ``counts`` against ``law``; outcomes expected fewer than 5 times are
    pooled (the chi-square approximation), an outcome the law excludes gives 0."""
    if not set(counts) <= set(law):
        return 0.0
    observed, expected = [], []
    rare_observed, rare_expected = 0, 0.0
    for outcome, p in law.items():
        if runs * p < 5:
            rare_observed += counts.get(outcome, 0)
            rare_expected += runs * p
        else:
            observed.append(counts.get(outcome, 0))
            expected.append(runs * p)
    if rare_expected > 0:
        observed.append(rare_observed)
        expected.append(rare_expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def count_outcomes(outputs: Iterable[Any]) -> dict[tuple[int, ...], int]:
    """How often each generated token sequence occurs among ``RequestOutput``s."""
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        outcome = tuple(output.outputs[0].token_ids)
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts
