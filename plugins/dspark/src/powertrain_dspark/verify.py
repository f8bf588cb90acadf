"""Lossless verification of one request's drafts against the target's logits.

Draft x_j, drawn from q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection the token comes from the normalised max(p_j − q_j, 0); when
every verified draft is accepted one bonus token comes from the target at the next
position. Whatever the drafts, each kept token is then distributed exactly as the
target would have sampled it. A deterministic drafter's draft is a point mass
(q_j(x_j) = 1), so it is accepted with probability p_j(x_j) and the residual is p_j
without x_j; that is drawn with the sampler's own noise (``_verify_point_masses``).
Greedy requests (temperature 0) accept a draft iff it is the target's argmax, and
otherwise emit the argmax — token-for-token what plain decoding gives.

``p_j`` is the sampler's own distribution for the request (temperature, top-k, top-p,
min-p: ``powertrain.interfaces.target_probs``), and every draw uses the
request's generator (seeded requests) or the engine's shared one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from powertrain.interfaces import SamplingParams, race_noise, row_argmax, target_probs


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
        best = row_argmax(target_logits).tolist()
        kept = []
        for j, draft in enumerate(drafts):
            if draft != best[j]:
                return [*kept, best[j]]
            kept.append(draft)
        return [*kept, best[len(drafts)]]
    probs = target_probs(target_logits, params)
    if draft_probs is None:
        return _verify_point_masses(drafts, probs, generator)
    uniforms = torch.rand(len(drafts), generator=generator).tolist()
    kept = []
    for j, draft in enumerate(drafts):
        p, q = probs[j], draft_probs[j].float()
        if uniforms[j] * float(q[draft]) < float(p[draft]):  # u < p/q without dividing by a tiny q
            kept.append(draft)
            continue
        return [*kept, draw_token((p - q).clamp_min(0), generator)]
    return [*kept, draw_token(probs[len(drafts)], generator)]


def _verify_point_masses(drafts: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """Deterministic drafts: draw the target's token at each position exactly as the
    sampler would (one exponential-race noise vector per token, from the same
    generator) and keep going while it equals the draft. The drawn token is the draft
    with probability p(x) and otherwise follows p without x — the rejection rule for a
    point mass — and a seeded request gets the very tokens plain decoding gives it."""
    kept = []
    for j in range(len(drafts) + 1):
        token = draw_token(probs[j], generator)
        kept.append(token)
        if j == len(drafts) or token != drafts[j]:
            return kept
    return kept


def draw_token(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to ``weights``: the sampler's exponential
    race, with one float32 noise vector over the vocabulary per token, as it draws."""
    noise = race_noise(torch.empty(weights.shape[-1], dtype=torch.float32), generator)
    return int((weights.float() / noise).argmax())
