"""Lossless verification of one request's drafts against the target's logits.

Draft x_j, drawn from q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection the token comes from the normalised max(p_j − q_j, 0); when
every verified draft is accepted one bonus token comes from the target at the next
position. Whatever the drafts, each kept token is then distributed exactly as the
target would have sampled it. A deterministic drafter's draft is a point mass
(q_j(x_j) = 1), so it is accepted with probability p_j(x_j) and the residual is p_j
without x_j. Greedy requests (temperature 0) accept a draft iff it is the target's
argmax, and otherwise emit the argmax — token-for-token what plain decoding gives.

``p_j`` is the sampler's own distribution for the request (temperature, top-k, top-p,
min-p: ``powertrain.engine.speculative.target_probs``), and every draw uses the
request's generator (seeded requests) or the engine's shared one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from powertrain.engine.sampling_params import SamplingParams
from powertrain.engine.speculative import target_probs


def verify_drafts(
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """``target_logits`` is ``[len(drafts) + 1, vocab]``: the target at the position
    before each draft, then after the last. Returns the accepted drafts and one token."""
    if target_logits.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"{len(drafts)} drafts need {len(drafts) + 1} rows of target logits, got {target_logits.shape[0]}"
        )
    if params.temperature == 0:
        best = target_logits.argmax(dim=-1).tolist()
        kept = []
        for j, draft in enumerate(drafts):
            if draft != best[j]:
                return [*kept, best[j]]
            kept.append(draft)
        return [*kept, best[len(drafts)]]
    probs = target_probs(target_logits, params)
    uniforms = torch.rand(len(drafts), generator=generator).tolist()
    kept = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if uniforms[j] * q_draft < float(p[draft]):  # u < p/q without dividing by a tiny q
            kept.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0
        else:
            residual = (p - draft_probs[j].float()).clamp_min(0)
        return [*kept, _draw(residual, generator)]
    return [*kept, _draw(probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to ``weights`` (exponential race, as the sampler)."""
    total = float(weights.sum())
    if total <= 0:  # p == q exactly (rejection had probability 0; rounding got here): p's argmax
        return int(weights.argmax())
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / total / noise).argmax())
