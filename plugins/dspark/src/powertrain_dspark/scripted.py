"""A drafter whose drafts a test decides: the target's own greedy answer, wrong on purpose at
chosen depths, so drafts are accepted and rejected by construction rather than by luck.

Why: on a tiny random model, whether an n-gram or MTP drafter ever guesses right (or ever
guesses wrong) depends on the checkpoint's seed; a test of rollback or of the lossless
verifier that needs both then fails at random. ``ScriptedDrafter`` drafts, for each
sequence, the tokens greedy decoding without speculation produced (``answers``, keyed by
prompt), so greedy verification accepts them; every other proposal for a sequence has one
draft replaced by another token, at a depth that cycles through the draft's length, so it is
rejected there and the drafts after it are thrown away.

Use it in place of the configured drafter with pytest's ``monkeypatch``::

    monkeypatch.setattr(powertrain_dspark.plugin, "make_drafter", scripted(answers))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from powertrain.interfaces import DraftSlot
from powertrain_dspark.drafter import DraftBatch


class ScriptedDrafter:
    def __init__(self, answers: Mapping[tuple[int, ...], Sequence[int]], max_draft_tokens: int) -> None:
        self.answers = {tuple(prompt): list(tokens) for prompt, tokens in answers.items()}
        self.max_draft_tokens = max_draft_tokens
        self._proposals: defaultdict[int, int] = defaultdict(int)
        #: Drafts made wrong on purpose, and drafts copied from the answer.
        self.wrong = self.right = 0

    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        drafts = []
        for slot in slots:
            prompt = tuple(slot.token_ids[: slot.num_prompt_tokens])
            if prompt not in self.answers:
                raise KeyError(f"ScriptedDrafter has no answer for a prompt of {len(prompt)} tokens: {prompt[:8]}...")
            generated = len(slot.token_ids) - slot.num_prompt_tokens  # answer[:generated] is already there
            tokens = self.answers[prompt][generated : generated + min(self.max_draft_tokens, slot.max_draft)]
            turn = self._proposals[slot.seq_id]
            self._proposals[slot.seq_id] += 1
            if tokens and turn % 2 == 1:
                depth = (turn // 2) % len(tokens)
                tokens[depth] = 1 if tokens[depth] == 0 else 0
                self.wrong += 1
                self.right += depth
            else:
                self.right += len(tokens)
            drafts.append(tokens)
        return DraftBatch(tokens=drafts, confidences=[[1.0] * len(t) for t in drafts])

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        pass


def scripted(answers: Mapping[tuple[int, ...], Sequence[int]]) -> Callable[[Any, Any], ScriptedDrafter]:
    """A stand-in for ``plugin.make_drafter`` that builds a ``ScriptedDrafter`` of ``answers``
    (with ``[dspark] max_draft_tokens``); the drafter built last is its ``.built``."""

    def make(context: Any, config: Any) -> ScriptedDrafter:
        make.built = ScriptedDrafter(answers, config.max_draft_tokens)  # type: ignore[attr-defined]
        return make.built  # type: ignore[attr-defined]

    return make
