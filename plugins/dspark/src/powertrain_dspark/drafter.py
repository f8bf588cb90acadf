"""What a drafter gives the speculative decoder: drafts per slot, with the drafter's raw
confidences and, for sampled drafts, the distributions they were drawn from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from powertrain.interfaces import DraftSlot, SamplingParams, row_argmax, target_probs
from powertrain_dspark.verify import draw_token


@attrs.frozen(kw_only=True)
class DraftBatch:
    """One ``propose``'s drafts, one entry per slot (same order as the slots).

    ``confidences[i][k]`` is the drafter's raw confidence in draft k+1 (calibration turns
    it into the policy's c(i, k+1)). ``draft_probs[i]`` is ``[len(tokens[i]), vocab]``,
    the distribution each draft was drawn from, or None for deterministic drafts (point
    masses); ``draft_probs`` None: every slot's drafts are deterministic.
    """

    tokens: list[list[int]]
    confidences: list[list[float]]
    draft_probs: list[torch.Tensor | None] | None = None

    def __attrs_post_init__(self) -> None:
        slots = len(self.tokens)
        if len(self.confidences) != slots or (self.draft_probs is not None and len(self.draft_probs) != slots):
            raise ValueError("a DraftBatch needs confidences (and draft_probs, if given) for every slot")

    def probs(self) -> list[torch.Tensor | None]:
        """One entry per slot: its draft distributions, or None."""
        return list(self.draft_probs) if self.draft_probs is not None else [None] * len(self.tokens)


class DraftSession(Protocol):
    """One step's drafts, drawn position by position on demand (``lengths.Drafting`` with raw
    confidences): the length rule draws only the drafts it verifies."""

    def confidence(self, row: int, position: int) -> float | None:
        """The raw confidence of draft ``position`` of slot ``row`` (the drafts before it
        drawn); None where the slot has no draft there."""
        ...

    def draw(self, wanted: Sequence[tuple[int, int]]) -> None:
        """Draw draft ``position`` of slot ``row`` for each pair (the drafts before it drawn;
        drawing one drawn already does nothing)."""
        ...

    def drafts(self) -> DraftBatch:
        """The drafts drawn so far."""
        ...


@attrs.frozen
class Drawn:
    """A ``DraftSession`` over drafts drawn in full (a drafter without ``session``)."""

    batch: DraftBatch

    def confidence(self, row: int, position: int) -> float | None:
        known = self.batch.confidences[row]
        return known[position - 1] if position <= len(known) else None

    def draw(self, wanted: Sequence[tuple[int, int]]) -> None:
        """Drawn already."""

    def drafts(self) -> DraftBatch:
        return self.batch


class Drafter(Protocol):
    """Optional, found by name: ``taps`` (the target's hidden states it reads, handed over in
    ``observe``'s ``ExecutedStep.taps``), ``observe(step)``, and ``session(slots)`` (a
    ``DraftSession``: drafts drawn on demand, for a drafter whose drafts are dear; without it
    the policy takes ``propose``'s)."""

    #: The most drafts it proposes for one slot.
    max_draft_tokens: int

    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        """Drafts for each slot (at most its ``max_draft``), with raw confidences."""
        ...

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        """How the drafts proposed for ``seq_id`` fared (0 verified: not looked at)."""
        ...


def draw_drafts(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[list[int], list[float], list[torch.Tensor | None]]:
    """One draft per row of a drafter's ``logits``: the argmax for a greedy request; for a
    sampling request a draw, with its own generator, from the distribution processed as the
    target's is (temperature, top-k/p, min-p: verification compares against that), which is
    returned as the draft's q (None for greedy rows). Also each row's largest probability,
    the drafter's own estimate of acceptance."""
    tokens = row_argmax(logits).tolist()
    raw = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
    q: list[torch.Tensor | None] = [None] * len(params)
    sampled = [row for row, p in enumerate(params) if p.temperature != 0]
    if sampled:
        host = logits[sampled].float().cpu()
        for row, row_logits in zip(sampled, host, strict=True):
            dist = target_probs(row_logits[None], params[row])[0]
            tokens[row] = draw_token(dist, generators[row])  # the sampler's race
            raw[row] = float(dist.max())
            q[row] = dist
    return tokens, raw, q
