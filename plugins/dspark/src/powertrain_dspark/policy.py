"""A drafter, a length rule and the verifier as one ``interfaces.SpeculativePolicy``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from powertrain.interfaces import DraftSlot, ExecutedStep, HiddenTap, Proposal, VerifyBatch
from powertrain_dspark.back_off import BackOff
from powertrain_dspark.calibration import Calibration
from powertrain_dspark.drafter import Drafter, DraftSession, Drawn
from powertrain_dspark.lengths import StepsPerSecond, StepsPerSecondGrid, dspark_rule, fixed_rule, top_k_rule
from powertrain_dspark.verify import verify_drafts


class SpeculativeDecoder:
    """``rule`` is "dspark" (confidence-scheduled) or "fixed" (``fixed_k`` drafts each)."""

    def __init__(
        self,
        drafter: Drafter,
        rule: str,
        *,
        sps: StepsPerSecond | StepsPerSecondGrid | None = None,
        fixed_k: int = 0,
        calibration: Calibration | None = None,
        lagged_budget: bool = False,
        log_path: str | Path | None = None,
        back_off: BackOff | None = None,
    ) -> None:
        if rule not in ("dspark", "fixed"):
            raise ValueError(f"unknown length rule {rule!r}; use 'dspark' or 'fixed'")
        if rule == "dspark" and sps is None:
            raise ValueError("the dspark rule needs the target's steps-per-second profile")
        self.drafter = drafter
        self.rule = rule
        self.sps = sps
        self.fixed_k = fixed_k
        self.calibration = calibration or Calibration()
        self.lagged_budget = lagged_budget
        self._budget: int | None = None  # K from the previous step (lagged variant)
        self._log = Path(log_path) if log_path else None
        self._raw: dict[int, list[float]] = {}
        #: Rests sequences whose drafts the rule keeps declining (None: every sequence drafts).
        self.back_off = back_off

    @property
    def max_draft_tokens(self) -> int:
        return self.drafter.max_draft_tokens

    @property
    def taps(self) -> tuple[HiddenTap, ...]:
        """The target's hidden states the drafter reads (none for most)."""
        return tuple(getattr(self.drafter, "taps", ()))

    def propose(self, slots: Sequence[DraftSlot], batch: VerifyBatch) -> Proposal:
        """Drafts and their lengths; a drafter with ``session`` draws only the drafts the rule
        verifies (``lengths``' module doc), and resting sequences (``back_off``) draft nothing."""
        back_off = self.back_off
        drafting = [i for i, slot in enumerate(slots) if back_off is None or not back_off.resting(slot.seq_id)]
        asked = [slots[i] for i in drafting]
        on_demand = getattr(self.drafter, "session", None)
        session = on_demand(asked) if on_demand is not None else Drawn(self.drafter.propose(asked))
        chosen = self.choose_lengths(_Calibrated(session, self.calibration), len(asked), batch)
        drafted = session.drafts()
        tokens: list[list[int]] = [[] for _ in slots]
        raw: list[list[float]] = [[] for _ in slots]
        probs: list[torch.Tensor | None] = [None] * len(slots)
        lengths = [0] * len(slots)
        drawn = drafted.probs()
        for row, i in enumerate(drafting):
            tokens[i], raw[i], probs[i] = list(drafted.tokens[row]), list(drafted.confidences[row]), drawn[row]
            lengths[i] = chosen[row]
        self._raw = {slots[i].seq_id: raw[i] for i in drafting}
        return Proposal(
            slots=list(slots),
            tokens=tokens,
            confidences=[self.calibration.apply(r) for r in raw],
            draft_probs=probs,
            lengths=lengths,
        )

    def choose_lengths(self, drafting: _Calibrated, rows: int, batch: VerifyBatch) -> list[int]:
        """How many drafts of each slot to verify (the rule's), drawing those it verifies."""
        if self.rule == "fixed":
            return fixed_rule(drafting, rows, self.fixed_k)
        assert self.sps is not None
        sps = self.sps
        if isinstance(sps, StepsPerSecondGrid):  # the curve for this step's sequence count
            sps = sps.for_sequences(batch.num_seqs or batch.num_sampling)
        greedy = dspark_rule(drafting, rows, sps, batch.base_tokens, batch.num_sampling)
        if not self.lagged_budget:
            return greedy
        budget = self._budget if self._budget is not None else sum(greedy)
        self._budget = sum(greedy)  # the next step's budget: from this step's confidences
        return top_k_rule(drafting, rows, budget)

    def verify(
        self, proposal: Proposal, lengths: Sequence[int], target_logits: Sequence[torch.Tensor]
    ) -> list[list[int]]:
        chosen = [i for i, n in enumerate(lengths) if n > 0]
        kept = []
        for i, logits in zip(chosen, target_logits, strict=True):
            slot, n = proposal.slots[i], lengths[i]
            probs = proposal.draft_probs[i]
            kept.append(
                verify_drafts(
                    proposal.tokens[i][:n], None if probs is None else probs[:n], logits, slot.params, slot.generator
                )
            )
        return kept

    def observe(self, step: ExecutedStep) -> None:
        lines = []
        for seq_id, accepted, drafts in zip(step.seq_ids, step.accepted, step.num_drafts, strict=True):
            if seq_id not in self._raw:
                continue
            raw = self._raw.pop(seq_id)
            num_accepted = max(len(accepted) - 1, 0) if drafts else 0
            self.drafter.record(seq_id, drafts, num_accepted)
            if self.back_off is not None:
                self.back_off.record(seq_id, drafts)
            if self._log is not None and drafts:
                lines.append(json.dumps({"raw": raw[:drafts], "accepted": num_accepted}) + "\n")
        if lines and self._log is not None:
            with self._log.open("a") as log:
                log.writelines(lines)
        if self.back_off is not None:
            self.back_off.end_step()
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:
            observe(step)


@attrs.frozen
class _Calibrated:
    """A ``DraftSession`` seen through the calibration: the rules' ``lengths.Drafting``."""

    session: DraftSession
    calibration: Calibration

    def confidence(self, row: int, position: int) -> float | None:
        raw = self.session.confidence(row, position)
        return None if raw is None else self.calibration.at(position, raw)

    def draw(self, wanted: Sequence[tuple[int, int]]) -> None:
        self.session.draw(wanted)
